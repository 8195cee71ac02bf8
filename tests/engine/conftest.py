import pytest

from tests.tiny import make_checkpoint
from tests.tp import TP_MODELS, engine, greedy, prompts


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory, tiny_tokenizer):
    """name (tests/tp.py TP_MODELS) -> a checkpoint folder, built once per session on first use."""
    root, built = tmp_path_factory.mktemp("tp_models"), {}

    def get(name: str):
        if name not in built:
            kind, overrides = TP_MODELS[name]
            built[name] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, name=name, **overrides)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tp1_tokens(tp_checkpoint):
    """name -> the TP = 1 (in-process runner) greedy tokens on tests/tp.py's prompts: the reference every
    executor's TP = 2 is compared with, computed once per session."""
    done = {}

    def get(name: str):
        if name not in done:
            eng = engine(tp_checkpoint(name), 1)
            done[name] = greedy(eng, prompts())
            eng.core.shutdown()
        return done[name]

    return get
