"""Shared fixtures for the engine tests.

Models:
- ``smollm2_dir``: the real SmolLM2-135M-Instruct checkpoint (pulled on first use, honours
  ``KVMESH_HOME``).
- ``tiny_llama_dir`` / ``tiny_qwen2_dir``: random tiny checkpoints written with transformers.
  They are initialised with a large ``initializer_range`` (0.2) so that greedy decoding is
  context dependent and the top-1/top-2 logit gap is far above float32 noise; RMSNorm weights
  and the Qwen2 q/k/v biases are randomised too, so loading them wrong changes the outputs.

  ===========  ====  ======  ====================================  ===============
  checkpoint   arch  layers  rope                                  lm_head
  ===========  ====  ======  ====================================  ===============
  tiny_llama   Llama 3       llama3 scaling (factor 4, orig. 64)   untied
  tiny_qwen2   Qwen2 2       linear scaling (factor 2)             tied, qkv bias
  ===========  ====  ======  ====================================  ===============

Threads: the machine is shared and has 2 cores. Measured here, one intra-op thread is 4-8x
faster than two when the other core is busy (OpenMP threads spin-waiting on a preempted
sibling), so the tests use ``KVMESH_TEST_THREADS`` (default 1).
"""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
import torch

from kvmesh.core.sampling import SamplingParams
from workers.executor import Completed

TEST_THREADS = int(os.environ.get("KVMESH_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)
# ... and so does every engine the suite starts in another process (the scheduler's engine core
# process, Ray stages, `kvmesh serve` and bench children): their default, the machine's cores,
# ran a mesh test 8x slower beside the other test worker (12 s alone, 98 s in `make test-all`).
# A test of the default thread split passes num_threads=0 itself.
os.environ.setdefault("KVMESH_NUM_THREADS", str(TEST_THREADS))
# Parity with transformers is checked in float32; `auto` picks bfloat16 on CPUs with native bf16.
os.environ.setdefault("KVMESH_DTYPE", "float32")
# ... and on the dense weights (the parity reference); the gguf format's tests ask for it. The
# variable covers EngineConfig.from_env (the LLM API, the CLI, subprocesses); an EngineConfig
# built directly gets the same default here instead of the product's `auto`.
os.environ.setdefault("KVMESH_WEIGHT_FORMAT", "none")


def _suite_engine_defaults() -> None:
    from kvmesh.core.engine_config import EngineConfig
    init = EngineConfig.__init__

    def __init__(self, *args, **kw):
        if "KVMESH_WEIGHT_FORMAT" in os.environ:         # a test may clear the environment
            kw.setdefault("weight_format", os.environ["KVMESH_WEIGHT_FORMAT"])
        if "KVMESH_NUM_THREADS" in os.environ:
            kw.setdefault("num_threads", int(os.environ["KVMESH_NUM_THREADS"]))
        init(self, *args, **kw)

    EngineConfig.__init__ = __init__


_suite_engine_defaults()

BLOCK = 16

# English prose used to build real-text prompts of exact token lengths.
PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden screw press adapted from the "
    "presses used to make wine and olive oil. Within fifty years, printing shops had opened in more "
    "than two hundred European cities, and millions of books were in circulation. Scholars could "
    "compare identical copies of a text for the first time, which changed how knowledge was checked "
    "and shared. Pamphlets spread news and arguments quickly, and the price of a book fell so far "
    "that ordinary merchants could own a small library. Printers also standardised spelling and "
    "punctuation, because a single edition reached readers in many regions. Later improvements, such "
    "as the steam-powered rotary press of the nineteenth century, made newspapers cheap enough to be "
    "sold on every street corner. Today most text is read on screens, yet the page layout of a "
    "modern web site still follows conventions that early printers invented: titles, margins, "
    "numbered pages, footnotes and an index at the end. Meanwhile, in a quiet mountain village, a "
    "baker named Clara rose every morning before dawn to light her oven. She mixed flour, water, "
    "salt and a spoonful of old dough, folded it gently and let it rest while the sky turned from "
    "black to grey. Her neighbours said that the smell of her bread could wake the whole valley. "
    "One winter the road to the city was closed by snow for three weeks, and Clara's small shop "
    "became the only place where people could buy food. She baked twice as much as usual, gave "
    "loaves to families who could not pay, and kept a list in pencil that she later threw away."
)


# ---------------------------------------------------------------------------------------------
# order: the modules holding slow tests first

# pyproject.toml's markers for what makes a test slow, the costliest kind first (the fuzzing
# alone takes minutes)
SLOW_MARKERS = ("fuzz", "quality", "compile", "chaos", "mesh", "multinode", "pull", "matrix")


def pytest_collection_modifyitems(config, items):
    """Modules holding a test marked slow for a reason run first, those with a costlier kind
    (:data:`SLOW_MARKERS`' order) before the others, each module's tests in their own order:
    pytest-xdist (``make test-all``) hands whole modules to its test processes in this order,
    so the long ones start early instead of one process running the fuzzing alone at the end."""
    rank: dict[str, int] = {}
    for item in items:
        if item.module is None:
            continue
        kinds = [i for i, m in enumerate(SLOW_MARKERS) if item.get_closest_marker(m)]
        name = item.module.__name__
        rank[name] = min([rank.get(name, len(SLOW_MARKERS)), *kinds])
    items.sort(key=lambda item: rank.get(item.module.__name__, len(SLOW_MARKERS)) if item.module else len(SLOW_MARKERS))


@pytest.fixture(scope="module", autouse=True)
def _module_memory(request):
    """After each module (its module-scoped engines torn down): collect garbage and give freed
    heap back (``malloc_trim``), so one test process that runs half the suite under
    pytest-xdist does not carry every module's freed pages. With ``KVMESH_TEST_RSS_LOG=FILE``
    each module's name and this process's RSS after it (MiB) are appended to ``FILE``: the
    check for a module that leaks (a test process was once killed for 20 GB)."""
    yield
    import gc

    from kvmesh.core.memory import release_free_memory
    gc.collect()
    release_free_memory()
    if path := os.environ.get("KVMESH_TEST_RSS_LOG"):
        import psutil
        rss = psutil.Process().memory_info().rss >> 20
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {os.getpid()} {request.module.__name__} {rss}\n")


# ---------------------------------------------------------------------------------------------
# checkpoints

@pytest.fixture(scope="session")
def smollm2_dir():
    """The pulled test model with its dense safetensors (`make pull` converts them at pull time):
    tests read it with transformers (parity) and serve it with --weight-format none."""
    from kvmesh.hub.pull import ensure_dense
    return ensure_dense("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def prose_ids(smollm2_tokenizer):
    """Token ids of real English text (SmolLM2 tokenizer), at least 300 of them."""
    ids = smollm2_tokenizer.encode(PROSE)
    assert len(ids) >= 300
    return ids


def _randomise_(model, bias_std: float = 0.0) -> None:
    """Make the parameters transformers initialises to constants random too."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(bias_std * torch.randn(p.shape, generator=g))


def _write_tiny(path, config, bias_std: float = 0.0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    _randomise_(model, bias_std)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


TINY_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                   rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig
    cfg = LlamaConfig(num_hidden_layers=3, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      **TINY_COMMON)
    return _write_tiny(tmp_path_factory.mktemp("tiny-llama"), cfg)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from transformers import Qwen2Config
    cfg = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "linear", "factor": 2.0}, **TINY_COMMON)
    return _write_tiny(tmp_path_factory.mktemp("tiny-qwen2"), cfg, bias_std=0.5)


# ---------------------------------------------------------------------------------------------
# helpers (exposed as fixtures so test modules need not import conftest)

def make_engine(model, **kw):
    """An LLMEngine on ``model`` (name or directory). ``num_blocks`` sizes the KV pool."""
    from kvmesh.core.engine_config import EngineConfig
    from scheduler.engine import LLMEngine
    num_blocks = kw.pop("num_blocks", None)
    kw.setdefault("kv_cache_memory", 96 * 2**20)    # SmolLM2: 136 blocks of 16 tokens
    kw.setdefault("max_model_len", 512)
    kw.setdefault("dtype", os.environ["KVMESH_DTYPE"])
    return LLMEngine(EngineConfig(model=str(model), **kw), num_blocks=num_blocks)


class WrappedExecutor:
    """An existing engine's executor (in-process or a Ray pipeline), wrapped: reused by another
    engine (same model, block size and max_model_len) so that a test can try several scheduler
    settings without reloading the weights, or put in place of an engine's own. The one wrapper
    of the tests. ``num_blocks`` may be smaller than the real pool (block ids stay valid).
    Blocks keep whatever K/V earlier engines left in them, as a real pool does.
    ``before_step(n)``, if given, runs before the model runs step ``n`` (1, 2, ... over this
    wrapper's life): it may sleep (a slow remote executor), abort requests from outside (a
    client disconnecting while the model runs) or raise (the step fails). ``observer``, if
    given, sees every step and free: ``observer.step(out)`` before the step is submitted,
    ``observer.stepped(out, result)`` after it ran (the step then completes before
    ``submit`` returns), ``observer.free(ids)``. ``shutdown`` leaves the base executor running."""

    def __init__(self, base, num_blocks: int | None = None, before_step=None, observer=None):
        self.base, self.before_step, self.observer, self.calls = base, before_step, observer, 0
        self.num_blocks = num_blocks or base.num_blocks
        assert self.num_blocks <= base.num_blocks
        self.kv_cache_bytes = base.kv_cache_bytes
        self.max_inflight = 1 if observer is not None else base.max_inflight

    def submit(self, out):
        self.calls += 1
        if self.before_step is not None:
            self.before_step(self.calls)
        if self.observer is None:
            return self.base.submit(out)
        self.observer.step(out)
        result = self.base.submit(out).result()
        self.observer.stepped(out, result)
        return Completed(result)

    def free_requests(self, ids):
        if self.observer is not None:
            self.observer.free(ids)
        self.base.free_requests(ids)

    def shutdown(self):
        pass


def derive_engine(engine, num_blocks: int | None = None, **overrides):
    """A new LLMEngine sharing ``engine``'s model and KV cache, with other settings."""
    from scheduler.engine import LLMEngine
    cfg = engine.cfg.replace(**overrides)
    assert cfg.block_size == engine.cfg.block_size and cfg.max_model_len == engine.cfg.max_model_len
    return LLMEngine(cfg, executor=WrappedExecutor(engine.executor, num_blocks))


def run_to_completion(engine, requests, max_steps: int = 100_000):
    """Add ``requests`` (list of (id, prompt_ids, SamplingParams)) and step until every one
    finished. Returns {id: Request}."""
    reqs = {rid: engine.add_request(rid, ids, sp) for rid, ids, sp in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        raise AssertionError("engine did not finish")
    engine.step()   # collect late outputs (aborts), a no-op otherwise
    assert all(r.is_finished for r in reqs.values())
    return reqs


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@contextlib.contextmanager
def redis_namespace():
    """``(url, prefix)``: the Redis at ``REDIS_URL`` (default redis://127.0.0.1:6379/0) and a
    unique key prefix; every key under the prefix is deleted afterwards. Skips the test when
    Redis is unreachable (fails it when ``CI`` is set)."""
    import redis
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    raw = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        raw.ping()
    except redis.RedisError as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"Redis not reachable at {url}: {e}")
    prefix = f"kvmesh-test-{uuid.uuid4().hex[:12]}"
    try:
        yield url, prefix
    finally:
        keys = list(raw.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            raw.delete(*keys)
        raw.close()


class LoopThread:
    """An asyncio event loop running on a daemon thread, for tests that drive async services
    (serve_scheduler, serve_gateway) from synchronous code: ``run(coro)`` waits for a coroutine
    on it; ``stop()`` ends the loop and joins the thread."""

    def __init__(self, name: str = "test-loop"):
        import asyncio
        import threading
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        import asyncio
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Helpers:
    LoopThread = LoopThread
    make_engine = staticmethod(make_engine)
    derive_engine = staticmethod(derive_engine)
    run = staticmethod(run_to_completion)
    greedy = staticmethod(greedy)
    redis_namespace = staticmethod(redis_namespace)
    BLOCK = BLOCK

    @staticmethod
    def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy ``generate`` with no EOS (exactly ``max_new_tokens`` tokens)."""
        from transformers import GenerationConfig
        gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=None,
                              eos_token_id=None, pad_token_id=0, bos_token_id=None)
        x = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = hf_model.generate(x, generation_config=gc, attention_mask=torch.ones_like(x))
        return out[0, len(prompt_ids):].tolist()

    @staticmethod
    def smaps() -> list[tuple[int, int, dict]]:
        """This process's mappings: ``(start, end, /proc/self/smaps fields)``, read once."""
        maps = []
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                maps.append((lo, hi, {}))
            elif maps:
                k, _, v = line.partition(":")
                maps[-1][2][k] = v.strip()
        return maps

    @staticmethod
    def vma_flags(addr: int, maps: list | None = None) -> dict:
        """The smaps fields of the mapping holding ``addr`` (in ``maps`` from :meth:`smaps`, or
        read now); empty when none holds it."""
        return next((f for lo, hi, f in (maps if maps is not None else Helpers.smaps()) if lo <= addr < hi), {})

    @staticmethod
    def capture_logits(engine) -> list[torch.Tensor]:
        """Record every ``[N, vocab]`` logits tensor the engine's model produces (one per step
        that samples). Relies only on the model's documented ``compute_logits``."""
        model = engine.executor.runner.model
        orig = model.compute_logits
        captured: list[torch.Tensor] = []

        def wrapper(hidden):
            out = orig(hidden)
            captured.append(out.detach().float().clone())
            return out

        model.compute_logits = wrapper
        return captured


@pytest.fixture(scope="session")
def h():
    return Helpers


@pytest.fixture(scope="session")
def wrap_executor():
    """``wrap_executor(base, num_blocks=None, before_step=None, observer=None)``: a
    :class:`WrappedExecutor` around the executor ``base``, for tests that act while a model step
    runs or look at every step."""
    return WrappedExecutor
