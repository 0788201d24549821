"""Runs SGLang's benchmark client, `python -m sglang.bench_serving`, with the arguments given.

The client imports one constant, FAKE_BOOTSTRAP_HOST, from SGLang's server package, whose import chain
needs a CUDA build of torchvision; that one module is replaced by the constant's value (sglang 0.5.23's).
Everything the client does over HTTP (request bodies, stream parsing, counting) is SGLang's own code."""

import sys
import types

_disaggregation_utils = types.ModuleType("sglang.srt.disaggregation.utils")
_disaggregation_utils.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]
sys.modules[_disaggregation_utils.__name__] = _disaggregation_utils

from sglang.benchmark.serving import cli_main  # noqa: E402 (after the module it needs is in place)

if __name__ == "__main__":
    cli_main()
