"""Shared fixtures: the embedded model (converted once per machine) and its transformers reference."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import pytest
import torch

# Without CUDA every Triton kernel runs in the interpreter. Triton reads the switch when it is first
# imported, and a test module may import it (through transformers) before importing labkit, which
# sets it otherwise (labkit/__init__.py); so set it before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor (--enable-torch-compile) compiles in the test's own process, for every test and the processes
# they start: waits on its pool of compile subprocesses have hung other projects' CI
# (areal-project/AReaL#701), and a CI run of labkit stopped at its limit with five fast-lane tests
# unfinished, tests/test_torch_compile.py possibly among them (which ones was not printed). Read when
# inductor's config is first imported, which `import torch` does not do.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# An xdist worker's CPU engines would each take the machine's cores less one (labkit's automatic
# thread count): on a 16-core GPU host, 15 workers spinning up to 15 threads each left the CPU-device
# tests unfinished after 520 s, against 96 s at one thread each. Share the cores out among the workers
# unless OMP_NUM_THREADS says otherwise (an engine then leaves torch's setting alone).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    from labkit.model_executor.model_runner import available_cores

    share = str(max(1, available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = os.environ["LABKIT_TEST_SHARED_THREADS"] = share
    torch.set_num_threads(int(share))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for `pytest -n 2 --dist loadgroup` (CI's slow lane): a test without an xdist_group of its
    own runs with the rest of its module, whose module-scoped servers and engines it shares. The
    notebooks set one group each (tests/test_notebooks.py), so two run at once."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _cuda_errors_stay_with_their_test():
    """A kernel's asynchronous CUDA error surfaces at the next synchronization, which may be the next
    test's setup (a GPU run once ended with every test of two files erroring at setup, the cause cut
    from its log). Synchronizing after each test makes the test that launched it report it."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@pytest.fixture(scope="session")
def embedded_dir():
    from labkit.model_loader.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_vocab_config(tmp_path_factory) -> str:
    """A tiny random-weight Llama with the embedded model's 49,152-token vocabulary, so it can borrow
    its tokenizer: a grammar alone decides what is well-formed, and a step takes milliseconds."""
    from labkit.model_loader.loader import CONFIGS_DIR

    config = json.loads((CONFIGS_DIR / "tiny-llama.json").read_text())
    config |= {"vocab_size": 49152, "max_position_embeddings": 2048}
    path = Path(tmp_path_factory.mktemp("configs")) / "tiny-llama-49k.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def tiny_engine_kwargs(tiny_vocab_config, embedded_dir) -> dict:
    """Engine keywords for the tiny model with the embedded tokenizer."""
    return {
        "model_path": tiny_vocab_config,
        "load_format": "dummy",
        "tokenizer_path": str(embedded_dir),
        "max_total_tokens": 8192,
        "device": "cpu",
    }


@pytest.fixture(scope="session")
def run_tiny_server(tiny_engine_kwargs):
    """run_tiny_server(test): asyncio.run `test(server, client)` against a started in-process server
    (labkit.server.inprocess) on the tiny model, `client` the official `openai` async client; then
    check that the server holds no memory."""
    import openai

    from labkit.config import EngineConfig
    from labkit.server.inprocess import InProcessServer

    def go(test):
        async def main():
            server = InProcessServer(EngineConfig(**tiny_engine_kwargs))
            await server.start()
            client = openai.AsyncOpenAI(base_url="http://labkit/v1", api_key="none", http_client=server.client)
            try:
                result = await test(server, client)
                usage = server.scheduler.pool_usage()
                assert usage.request_owned == 0 and usage.protected == 0 and not server.scheduler.has_work()
                return result
            finally:
                await server.close()

        return asyncio.run(main())

    return go


@pytest.fixture(scope="session")
def hf_tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


@pytest.fixture(scope="session")
def hf_model(embedded_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    return model.eval()


# --- labkit paged-KV harness (models / attention tests) -------------------------------------------
class PagedKVHarness:
    """Real ReqToTokenPool + TokenToKVPool + an attention backend, with KV slots assigned by hand
    page by page from a shuffled page list (so a request's pages are not contiguous)."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        num_pages: int = 96,
        max_reqs: int = 8,
        max_ctx: int = 512,
        seed: int = 0,
        backend: str = "torch_native",
    ):
        from labkit.attention import ATTENTION_BACKENDS, AttentionBackendConfig
        from labkit.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

        self.page_size = page_size
        self.req_pool = ReqToTokenPool(max_reqs, max_ctx)
        self.kv_pool = TokenToKVPool(num_pages * page_size, page_size, dtype, num_layers, num_kv_heads, head_dim)
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is reserved
        random.Random(seed).shuffle(self.free_pages)
        self.lens: dict[int, int] = {}
        self.backend = ATTENTION_BACKENDS[backend](
            AttentionBackendConfig(
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=page_size,
                max_context_len=max_ctx,
                max_batch_size=max_reqs,
                dtype=dtype,
                device=torch.device("cpu"),
            )
        )

    def new_req(self, share_from: int | None = None, prefix_len: int = 0) -> int:
        """A request slot; optionally reusing the first prefix_len KV slots of request share_from."""
        assert prefix_len % self.page_size == 0, "shared prefixes are whole pages"
        req = self.req_pool.alloc(1)[0]
        if share_from is not None:
            self.req_pool.req_to_token[req, :prefix_len] = self.req_pool.req_to_token[share_from, :prefix_len]
        self.lens[req] = prefix_len
        return req

    def batch(self, mode, items: list[tuple[int, int]], input_ids: torch.Tensor | None = None):
        """ForwardBatch adding n_new tokens to each (req, n_new), allocating their KV slots."""
        from labkit.model_executor.forward_batch import ForwardBatch

        r2t, ps = self.req_pool.req_to_token, self.page_size
        locs, positions, prefix_lens, seq_lens = [], [], [], []
        for req, n in items:
            start = self.lens[req]
            for pos in range(start, start + n):
                page = self.free_pages.pop() if pos % ps == 0 else int(r2t[req, pos - 1]) // ps
                r2t[req, pos] = page * ps + pos % ps
            locs.append(r2t[req, start : start + n].clone())
            positions.append(torch.arange(start, start + n))
            prefix_lens.append(start)
            seq_lens.append(start + n)
            self.lens[req] = start + n
        num_tokens = sum(n for _, n in items)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(items),
            input_ids=input_ids if input_ids is not None else torch.zeros(num_tokens, dtype=torch.int64),
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor([r for r, _ in items], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=[n for _, n in items],
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )


@pytest.fixture
def paged_kv_harness() -> type[PagedKVHarness]:
    """The PagedKVHarness class (construct it with the model's shapes)."""
    return PagedKVHarness
