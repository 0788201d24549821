"""`Runtime`: SGLang's `sgl.Runtime`, a server started from the program's process: here `python -m
labkit.server` as a child process, used through a `RuntimeEndpoint`."""

from __future__ import annotations

from typing import Any

from labkit.lang.runtime_endpoint import RuntimeEndpoint
from labkit.server.process import START_TIMEOUT_S, start_server


class Runtime:
    """Start a labkit server with these options (the server's own names: `model_path=...`,
    `tp_size=2`, `enable_metrics=True`; a false or None value leaves the option at its default) and
    wait until it answers. `set_default_backend(runtime)` and `run(backend=runtime)` use its
    `endpoint`; `shutdown()` stops it (SIGTERM) and returns its exit code."""

    def __init__(self, log_level: str = "error", launch_timeout: float = START_TIMEOUT_S, **server_args: Any):
        flags: list[str] = ["--log-level", log_level]
        for name, value in server_args.items():
            if value is None or value is False:
                continue
            flags.append("--" + name.replace("_", "-"))
            if value is not True:
                flags.append(str(value))
        self._server = start_server(*flags, timeout=launch_timeout)
        self.url = self._server.url
        self.endpoint = RuntimeEndpoint(self.url)

    def shutdown(self) -> int:
        self.endpoint.close()
        return self._server.stop()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
