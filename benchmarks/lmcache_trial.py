"""Does LMCache's engine (PyPI `lmcache` 0.5.6) run on this machine? Tries it step by step and says how far it got.

1. lmcache's version and where it was imported from (with Python, torch and its CUDA);
2. its native extensions `lmcache.cuda_ops` and `lmcache.lmcache_native`: imported, or the exact error (a missing
   libcudart.so.13, or an undefined torch symbol = built against another torch), and whether `lmcache.device_ops`
   runs on cuda_ops' kernels or on LMCache's torch fallback (it falls back silently when cuda_ops fails);
3. `import lmcache.v1.cache_engine`, listing every missing module by name: each one is stubbed so that the loop
   can go on to the next (nothing is installed); with any missing, the engine steps are skipped;
4. a CUDA device (on a machine without one, the trial ends here with "no CUDA");
5.-9. an LMCacheEngine as LMCacheEngineBuilder.get_or_create builds it, with a local-CPU backend (256 MB) and the
   vLLM paged-memory connector (VLLMPagedMemGPUConnectorV2, from CreateGPUConnector) over a vLLM flash-attention
   layout (4 layers of [2, blocks, 16, 8 KV heads, 128] bf16); it stores the KV of a 512-token sequence, retrieves it
   into the zeroed pages under another slot mapping and checks with torch.equal that the same KV came back; store and
   retrieve are timed (host wall time, synchronized).
Last line: "LMCache engine round trip OK on <GPU>" or "LMCache stops at step N: <error>".

    python -m benchmarks.lmcache_trial [--json out.json]

Most of lmcache's requirements are absent from the GPU image (Python 3.12, torch 2.11+cu130, no network): install
its cp312 wheel and the wheels that its imports need, with no dependencies, into a folder first on PYTHONPATH:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
        lmcache-0.5.6-cp312-*.whl aiofile-*.whl caio-*.whl blake3-*.whl cufile_python-*.whl cachetools-*.whl \\
        msgspec-*.whl pyzmq-*.whl cryptography-*.whl cffi-*.whl pycparser-*.whl \\
        aiofiles-*.whl py_cpuinfo-*.whl sortedcontainers-*.whl
    PYTHONPATH=/tmp/site python3 -m benchmarks.lmcache_trial --json $OUT/lmcache_trial.json

(cachetools, msgspec, pyzmq and cryptography (with cffi, pycparser) are imported by lmcache.v1.cache_engine; the
last three on the list come with the image anyway. numba, numpy, aiohttp, psutil, PyYAML, prometheus_client and
transformers come with the image: don't carry them, a carried numpy would shadow the one its packages were built
with. nvtx is optional (lmcache falls back to a no-op decorator).)
Usage telemetry is switched off (LMCACHE_TRACK_USAGE=false): nothing may phone home from here.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import platform
import sys
import time
import traceback
import types
from dataclasses import asdict, dataclass, field

# Before lmcache is first imported: its engine otherwise starts a thread that posts usage reports to its servers.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 16, 8, 128
NUM_BLOCKS = 256  # 4096 slots, 8 MiB a layer
TOKENS = 512
CHUNK = 256  # LMCache's default chunk: the sequence is two chunks
CPU_GB = 0.25  # the local-CPU backend's pinned pool
DTYPE = torch.bfloat16
INSTANCE = "kestrel-lmcache-trial"
DEVICE = "cuda"
MAX_MISSING = 40


@dataclass
class Step:
    n: int
    name: str
    ok: bool = False
    detail: str = ""
    error: str = ""
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


class Trial:
    """Runs numbered steps, each in its own try/except, and keeps what each one found."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def run(self, name: str, fn, *args):
        step = Step(len(self.steps) + 1, name)
        self.steps.append(step)
        print(f"[{step.n}] {name} ...", flush=True)
        t0 = time.perf_counter()
        result = None
        try:
            result = fn(step, *args)
            step.ok = not step.error
        except Exception as e:  # noqa: BLE001 - a failed step is a result
            step.error = f"{type(e).__name__}: {e}"
            step.data["traceback"] = traceback.format_exc(limit=8)
        step.seconds = round(time.perf_counter() - t0, 4)
        status = "ok" if step.ok else "FAILED"
        print(f"[{step.n}] {name}: {status}" + (f" - {step.detail}" if step.detail else ""), flush=True)
        if step.error:
            print(f"    {step.error}", flush=True)
        return result

    def skip(self, name: str, why: str) -> None:
        step = Step(len(self.steps) + 1, name, error=f"skipped: {why}")
        self.steps.append(step)
        print(f"[{step.n}] {name}: skipped ({why})", flush=True)


# ---- steps 1-3: imports ---------------------------------------------------------------------------------------------

def step_version(step: Step):
    import lmcache
    step.data.update(lmcache=getattr(lmcache, "__version__", "unknown"), path=os.path.dirname(lmcache.__file__),
                     python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda)
    step.detail = (f"lmcache {step.data['lmcache']} from {step.data['path']}; Python {step.data['python']}, "
                   f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    return lmcache


def step_native(step: Step, lmcache):
    errors = {}
    for name in ("lmcache.cuda_ops", "lmcache.lmcache_native"):
        try:
            importlib.import_module(name)
            step.data[name] = "imported"
        except Exception as e:  # noqa: BLE001
            errors[name] = step.data[name] = f"{type(e).__name__}: {e}"
        print(f"    {name}: {step.data[name]}", flush=True)
    step.data["device_ops"] = device_ops_backend(lmcache)
    print(f"    lmcache.device_ops: {step.data['device_ops']}", flush=True)
    step.detail = f"device_ops: {step.data['device_ops']}"
    step.error = "; ".join(f"{k}: {v}" for k, v in errors.items())


def device_ops_backend(lmcache) -> str:
    """Which implementation lmcache's KV copies will use: cuda_ops' kernels or LMCache's torch fallback."""
    ops = getattr(lmcache, "device_ops", None)
    if ops is None:
        try:  # lmcache/__init__ only logs why; ask again to get the exception
            from lmcache.v1.platform import resolve_device_ops
            resolve_device_ops(lmcache.torch_device_type)
            return "absent from lmcache (resolving it again worked)"
        except Exception as e:  # noqa: BLE001
            return f"absent: {type(e).__name__}: {e}"
    native = "multi_layer_kv_transfer" in vars(ops)  # bind_native sets each kernel on the instance
    return f"{type(ops).__name__} on {'native cuda_ops kernels' if native else 'the torch fallback'}"


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class _Stub(metaclass=_StubMeta):
    """Whatever a missing module is asked for: a class that can be subclassed, called, or used as a decorator."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __init_subclass__(cls, **kwargs) -> None:  # class Cmd(msgspec.Struct, tag=True)
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Stub()


def _stub_class(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class MissingModuleStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for modules this machine lacks, so that the import loop can go on to find the next missing one."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


def step_import_engine(step: Step):
    stubs = MissingModuleStubs()
    sys.meta_path.insert(0, stubs)
    failure = ""
    for _ in range(MAX_MISSING):
        try:
            importlib.import_module("lmcache.v1.cache_engine")
            break
        except ModuleNotFoundError as e:
            if not e.name or e.name in stubs.names:
                failure = f"{type(e).__name__}: {e}"
                break
            print(f"    missing module: {e.name}  ({where_imported(e)})", flush=True)
            stubs.names.append(e.name)
        except Exception as e:  # noqa: BLE001 - an undefined symbol, or a stub that could not stand in
            failure = f"{type(e).__name__}: {e} ({where_imported(e)})"
            break
    else:
        failure = f"gave up after {MAX_MISSING} missing modules"
    step.data["missing"] = stubs.names
    if stubs.names:
        step.error = f"missing modules: {', '.join(stubs.names)}" + (f"; with those stubbed, {failure}" if failure else "")
        step.detail = "nothing was installed; " + ("the import still fails" if failure else "imports with those stubbed")
    elif failure:
        step.error = failure
    else:
        step.detail = "imported"


def where_imported(e: BaseException) -> str:
    """The innermost lmcache file:line in the exception's traceback (who imported the missing module)."""
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        if f"{os.sep}lmcache{os.sep}" in frame.filename:
            where = f"{frame.filename.rsplit(os.sep + 'lmcache' + os.sep, 1)[-1]}:{frame.lineno}"
    return f"lmcache/{where}" if where != "?" else where


# ---- step 4 on: the engine round trip -------------------------------------------------------------------------------

def step_cuda(step: Step) -> str:
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA: torch {torch.__version__} (built with CUDA {torch.version.cuda}) sees no GPU")
    name = torch.cuda.get_device_name(0)
    step.data.update(gpu=name, capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    step.detail = f"{name}, sm_{step.data['capability'].replace('.', '')}"
    return name


def step_config(step: Step):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=CPU_GB,
                                               lmcache_instance_id=INSTANCE)
    config.validate()
    metadata = LMCacheMetadata(model_name="kestrel-trial", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=DTYPE, kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM),
                               chunk_size=CHUNK)
    step.detail = f"chunk {CHUNK}, local CPU {CPU_GB} GB, kv_shape {metadata.kv_shape} {DTYPE}"
    return config, metadata


def step_connector(step: Step, config, metadata):
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector import CreateGPUConnector

    connector = CreateGPUConnector(config, metadata, EngineType.VLLM)
    step.detail = type(connector).__name__
    return connector


def step_engine(step: Step, config, metadata, connector):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get_or_create(INSTANCE, config, metadata, connector,
                                                broadcast_fn=lambda tensor, src: None,
                                                broadcast_object_fn=lambda obj, src: obj)
    engine.post_init()  # creates the storage manager and its LocalCPUBackend
    backends = list(engine.storage_manager.storage_backends) if engine.storage_manager else []
    step.detail = f"{type(engine).__name__}, backends {backends}"
    return engine


def paged_kv() -> list[torch.Tensor]:
    """vLLM flash-attention layout, random: one [2, blocks, block_size, kv_heads, head_dim] tensor a layer."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape, dtype=DTYPE, device=DEVICE) for _ in range(LAYERS)]


def by_slot(layer: torch.Tensor) -> torch.Tensor:
    return layer.view(2, NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def slots(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:TOKENS].to(DEVICE)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def step_store(step: Step, engine):
    tokens = torch.randint(0, 32000, (TOKENS,), generator=torch.Generator().manual_seed(0))
    kv, src_slots = paged_kv(), slots(1)
    stored = [by_slot(layer)[:, src_slots].clone() for layer in kv]
    _, ms = timed(lambda: engine.store(tokens, kvcaches=kv, slot_mapping=src_slots))
    found = wait_for_lookup(engine, tokens, timeout_s=10.0)
    step.data.update(store_ms=round(ms, 3), lookup_tokens=found)
    step.detail = f"store {ms:.2f} ms ({TOKENS} tokens, {kv_mib():.0f} MiB); lookup finds {found} tokens"
    if found != TOKENS:
        step.error = f"lookup finds {found} of {TOKENS} stored tokens"
    return tokens, kv, src_slots, stored


def wait_for_lookup(engine, tokens, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    found = engine.lookup(tokens)
    while found < TOKENS and time.monotonic() < deadline:
        time.sleep(0.01)
        found = engine.lookup(tokens)
    return found


def kv_mib() -> float:
    return TOKENS * LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize / 2**20


def step_retrieve(step: Step, engine, stored_state):
    # Into the same tensors, zeroed: the connector keeps the page pointers of the first KV caches it is given (vLLM
    # registers its caches once), so retrieving into other tensors would write into the first ones.
    tokens, kv, src_slots, stored = stored_state
    dst_slots = slots(2)
    assert not torch.equal(dst_slots, src_slots)
    for attempt in ("cold", "warm"):
        for layer in kv:
            layer.zero_()
        mask, ms = timed(lambda: engine.retrieve(tokens, kvcaches=kv, slot_mapping=dst_slots))
        got = int(mask.sum())
        same = got == TOKENS and kv_equal(stored, kv, dst_slots)
        step.data[f"retrieve_{attempt}_ms"] = round(ms, 3)
        step.data[f"retrieve_{attempt}_equal"] = same
        print(f"    retrieve ({attempt}): {ms:.2f} ms, {got}/{TOKENS} tokens, KV equal: {same}", flush=True)
        if not same:
            step.error = f"{attempt} retrieve: {got}/{TOKENS} tokens, retrieved KV differs from the stored KV"
            return
    step.detail = (f"retrieve {step.data['retrieve_cold_ms']:.2f} ms cold, {step.data['retrieve_warm_ms']:.2f} ms "
                   f"warm; torch.equal on every layer, all other slots still zero")


def kv_equal(stored: list[torch.Tensor], kv: list[torch.Tensor], dst_slots: torch.Tensor) -> bool:
    """The retrieved slots hold exactly the stored KV, and every other slot of the zeroed pages is still zero."""
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    untouched[dst_slots] = False
    for want, layer in zip(stored, kv):
        if not torch.equal(want, by_slot(layer)[:, dst_slots]) or by_slot(layer)[:, untouched].any():
            return False
    return True


def destroy_engine() -> None:
    try:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        if LMCacheEngineBuilder.get(INSTANCE) is not None:
            LMCacheEngineBuilder.destroy(INSTANCE)
    except Exception as e:  # noqa: BLE001 - teardown must not hide the result
        print(f"    (teardown: {type(e).__name__}: {e})", flush=True)


# ---- driver ---------------------------------------------------------------------------------------------------------

def run_trial() -> tuple[Trial, str]:
    trial = Trial()
    lmcache = trial.run("import lmcache", step_version)
    if lmcache is None:
        return trial, verdict(trial)
    trial.run("native extensions", step_native, lmcache)
    trial.run("import lmcache.v1.cache_engine", step_import_engine)
    if not trial.steps[-1].ok:
        trial.skip("engine round trip", "lmcache.v1.cache_engine does not import")
        return trial, verdict(trial)
    gpu = trial.run("CUDA device", step_cuda)
    if gpu is not None:
        try:
            round_trip(trial)
        finally:
            destroy_engine()
    return trial, verdict(trial, gpu)


def round_trip(trial: Trial) -> None:
    chain = trial.run("engine config + metadata", step_config)
    if chain is None:
        return
    connector = trial.run("GPU connector (vLLM paged)", step_connector, *chain)
    if connector is None:
        return
    engine = trial.run("LMCacheEngineBuilder.get_or_create + post_init", step_engine, *chain, connector)
    if engine is None:
        return
    state = trial.run(f"store {TOKENS} tokens", step_store, engine)
    if state is not None:
        trial.run("retrieve into zeroed pages, other slots", step_retrieve, engine, state)


def verdict(trial: Trial, gpu: str | None = None) -> str:
    native = trial.steps[1] if len(trial.steps) > 1 else None
    for step in trial.steps:
        if not step.ok and step is not native:
            return f"LMCache stops at step {step.n} ({step.name}): {step.error}"
    if gpu is None:
        return "LMCache stops before the engine steps"
    note = ""
    if native is not None and native.error:
        note = f" (KV copies on {native.data.get('device_ops')}; {native.error})"
    elif native is not None:
        note = f" ({native.data.get('device_ops')})"
    return f"LMCache engine round trip OK on {gpu}{note}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="write the steps and the verdict here")
    args = ap.parse_args(argv)
    trial, line = run_trial()
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"verdict": line, "ok": line.startswith("LMCache engine round trip OK"),
                       "steps": [asdict(s) for s in trial.steps]}, f, indent=2, default=str)
    return 0 if line.startswith("LMCache engine round trip OK") else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # LMCache's storage manager runs its event loop on a non-daemon thread: a plain exit could wait on it forever.
    os._exit(rc)
