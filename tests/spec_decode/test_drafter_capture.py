"""The draft models' capture of the target's hidden states (kestrel/spec_decode/hidden_capture.py HiddenCapture): the
hooks copy into one static buffer (what lets CUDA graphs replay with a drafter loaded); on the CPU the same path
runs eagerly. After every step of a mixed workload (prefill chunks, decodes, verify steps) the rows the runner
hands the drafter equal what plain forward hooks (the capture before the static buffer) see in that forward:
MTP's final-norm input, EAGLE-3's residual stream entering its aux layers side by side."""
import pytest
import torch

from kestrel import LLM
from kestrel.spec_decode.hidden_capture import FinalNormInput, HiddenCapture, LayerInput
from tests.spec_decode.eagle3_tiny import eagle3_draft, eagle3_target
from tests.spec_decode.mixed import workload
from tests.spec_decode.mtp_tiny import mtp_checkpoint


def hook_final_norm_input(model, seen: dict) -> None:
    model.norm.register_forward_hook(
        lambda module, args, output: seen.__setitem__(0, output[1] if isinstance(output, tuple) else args[0]))


def hook_layer_inputs(model, layers: list[int], seen: dict) -> None:
    for i in layers:
        model.layers[i].register_forward_pre_hook(
            lambda module, args, i=i: seen.__setitem__(i, args[1] if args[2] is None else args[1] + args[2]))


@pytest.fixture(scope="module")
def mtp_llm(tmp_path_factory):
    path = mtp_checkpoint(tmp_path_factory.mktemp("capture_mtp"))
    return LLM(str(path), progress=False, max_num_batched_tokens=24, num_kv_blocks=12,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def eagle3_llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_eagle3")
    target = eagle3_target(root)
    draft = eagle3_draft(root, target, "speculators", seed=2, aux=[1, 3, 6], own_embed=True)
    return LLM(str(target), progress=False, max_num_batched_tokens=24,
               speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})


def check_rows_after_each_step(llm, reference) -> list[int]:
    """Run the mixed workload; at each step compare the drafter's rows with `reference()` (the plain hooks'
    hidden states of the same forward). Returns the token counts of the steps checked."""
    drafter = llm.engine.core.executor.runner.drafter
    rows, checked = drafter.capture.rows, []

    def checking(num_tokens):
        got = rows(num_tokens)
        want = reference()
        assert want.shape == got.shape and torch.equal(got, want.to(got.dtype))
        checked.append(num_tokens)
        return got

    drafter.capture.rows = checking
    try:
        prompts, params = workload(4)
        llm.generate(prompts, params)
    finally:
        del drafter.capture.rows
    return checked


def test_mtp_rows_equal_final_norm_input(mtp_llm):
    seen = {}
    hook_final_norm_input(mtp_llm.engine.core.executor.runner.model, seen)
    checked = check_rows_after_each_step(mtp_llm, lambda: seen.pop(0))
    assert len(checked) > 10 and max(checked) == 24 and min(checked) < 8  # full prefill chunks and decode steps
    assert mtp_llm.engine.core.speculation.num_drafts > 0


def test_eagle3_rows_equal_aux_layer_inputs_side_by_side(eagle3_llm):
    runner = eagle3_llm.engine.core.executor.runner
    assert runner.drafter.aux_layers == [1, 3, 6]
    seen = {}
    hook_layer_inputs(runner.model, [1, 3, 6], seen)

    def reference():
        out = torch.cat([seen[i] for i in (1, 3, 6)], dim=-1)
        seen.clear()
        return out

    checked = check_rows_after_each_step(eagle3_llm, reference)
    assert len(checked) > 10 and max(checked) == 24 and min(checked) < 8
    assert eagle3_llm.engine.core.speculation.num_drafts > 0


class _Layer(torch.nn.Module):
    def forward(self, positions, hidden, residual):
        return hidden * 2, hidden if residual is None else hidden + residual


class _Norm(torch.nn.Module):
    def forward(self, hidden, residual):
        return hidden * 3, hidden + residual


class _Target(torch.nn.Module):
    """Two layers and a fused add-norm, called as the engine's decoders call theirs."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.norm = _Norm()

    def forward(self, x):
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(None, hidden, residual)
        return self.norm(hidden, residual)[0]


def test_buffer_rows_are_a_copy_and_oversized_forwards_are_refused():
    model = _Target()
    capture = HiddenCapture(model, [LayerInput(0), LayerInput(1), FinalNormInput()], 4, 6, "cpu", torch.float32)
    x = torch.randn(5, 4)
    model(x)
    first = capture.rows(5)
    layer1_in = 2 * x + x  # layer 0 returns (2x, x): hidden + residual entering layer 1
    norm_in = 2 * (2 * x) + layer1_in
    assert torch.equal(first, torch.cat([x, layer1_in, norm_in], dim=-1))
    model(torch.randn(3, 4))  # a later forward (a pipelined step) leaves rows already taken alone
    assert torch.equal(first, torch.cat([x, layer1_in, norm_in], dim=-1))
    with pytest.raises(RuntimeError, match="a target forward of 7 tokens; the drafter's capture holds 6"):
        model(torch.randn(7, 4))
