"""Our config and tokenizer loads give transformers' AutoConfig / AutoTokenizer results (same class, same values)
for every family the tiny checkpoints cover, and without importing transformers' model code (modeling_auto,
generation, FSDP, DTensor, dynamo, sklearn): the ~3-5 s of start-up that issue 32 removed. The loads run in a fresh
process, where nothing else has imported those modules yet."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import BASE, CONFIGS, DSA_CONFIGS, KDA_CONFIGS, MLA_MOE_CONFIGS, MOE_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
# (not torch.distributed.tensor: 13 config modules, llama's among them, validate `hidden_act` against transformers'
# activations, whose import chain reaches it)
HEAVY = ("transformers.models.auto.modeling_auto", "transformers.generation.utils", "sklearn")
FAMILIES = {**CONFIGS, **MOE_CONFIGS, **MLA_MOE_CONFIGS, **KDA_CONFIGS, **DSA_CONFIGS}


def run_fresh(code: str) -> dict:
    """Run `code` in a new interpreter; it prints one JSON object last."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def config_folders(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("configs")
    folders = {}
    for kind, (model_type, extra) in FAMILIES.items():
        AutoConfig.for_model(model_type, **{**BASE, **extra}).save_pretrained(root / kind)
        folders[kind] = root / kind
    return folders


def test_configs_equal_autoconfig_without_model_code(config_folders):
    from transformers import AutoConfig

    got = run_fresh(f"""
import json, sys
from kestrel.loader import load_hf_config
out = {{}}
for kind, path in {json.dumps({k: str(v) for k, v in config_folders.items()})}.items():
    c = load_hf_config(path)
    out[kind] = [type(c).__module__ + "." + type(c).__qualname__, c.to_dict()]
out["heavy"] = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps(out))
""")
    assert got.pop("heavy") == []
    for kind, path in config_folders.items():
        ref = AutoConfig.from_pretrained(path)
        cls, values = got[kind]
        assert cls == f"{type(ref).__module__}.{type(ref).__qualname__}", kind
        assert values == json.loads(json.dumps(ref.to_dict())), kind


def test_for_model_equals_autoconfig():
    from transformers import AutoConfig

    from kestrel.loader import light_auto

    for model_type, extra in (FAMILIES["llama_gqa_llama3"], FAMILIES["qwen3"]):
        kwargs = {**BASE, **extra}
        ours, ref = light_auto.config_for_model(model_type, **kwargs), AutoConfig.for_model(model_type, **kwargs)
        assert type(ours) is type(ref) and ours.to_dict() == ref.to_dict()


def test_engine_start_imports_no_model_code(tiny_models):
    """An engine built from a real checkpoint (config, weights, tokenizer) keeps transformers' model code out; the
    tokenizers (of every tiny family) are AutoTokenizer's."""
    folders = {k: str(v) for k, v in tiny_models.items()}
    got = run_fresh(f"""
import json, sys
from kestrel import LLM
from kestrel.loader import load_tokenizer
llm = LLM({folders["qwen3"]!r}, max_num_seqs=4, max_num_batched_tokens=128, progress=False)
out = {{"heavy": [m for m in {HEAVY + ("torch.distributed.tensor", "torch._dynamo")!r} if m in sys.modules],
        "engine": llm.engine.tokenizer.encode("hello world")}}
for kind, path in {folders!r}.items():
    tok = load_tokenizer(path)
    out[kind] = [type(tok).__module__ + "." + type(tok).__qualname__, tok.encode("hello world")]
print(json.dumps(out))
""")
    from transformers import AutoTokenizer

    assert got.pop("heavy") == []
    assert got.pop("engine") == AutoTokenizer.from_pretrained(tiny_models["qwen3"]).encode("hello world")
    for kind, path in tiny_models.items():
        ref = AutoTokenizer.from_pretrained(path)
        assert got[kind] == [f"{type(ref).__module__}.{type(ref).__qualname__}", ref.encode("hello world")], kind


def test_remote_code_models_still_get_generation_mixin():
    """auto_factory imported our way: its one user of GenerationMixin imports the real class when it first runs."""
    got = run_fresh("""
import inspect, json, sys, torch
from kestrel.loader import light_auto
light_auto.import_auto_classes()
af = sys.modules["transformers.models.auto.auto_factory"]

def names(obj):  # every global or attribute name the code of a function or a class's methods uses
    if isinstance(obj, type):
        return set().union(*(names(v) for v in vars(obj).values())) if obj.__module__ == af.__name__ else set()
    code = getattr(inspect.unwrap(getattr(obj, "__func__", obj)), "__code__", None)
    out, stack = set(), [code] if code else []
    while stack:
        c = stack.pop()
        out |= set(c.co_names)
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    return out

users = sorted(n for n, obj in vars(af).items() if "GenerationMixin" in names(obj))
before = "transformers.generation.utils" in sys.modules

class Remote(torch.nn.Module):
    def prepare_inputs_for_generation(self):
        pass

mixed = af.add_generation_mixin_to_remote_model(Remote)
from transformers import GenerationMixin
print(json.dumps({"users": users, "before": before, "mixed": issubclass(mixed, GenerationMixin),
                  "bound": af.GenerationMixin is GenerationMixin}))
""")
    assert got == {"users": ["add_generation_mixin_to_remote_model"], "before": False, "mixed": True, "bound": True}
