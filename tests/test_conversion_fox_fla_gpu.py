"""Parity with flash-linear-attention's own FoX model (GPU; FLA installed from its wheels).

FLA's ForgettingTransformerForCausalLM with random weights is saved by FLA itself, converted with
`hf-hybrid convert fox`, and both models run the same tokens. In fp32 both are compared to the
float64 restatement of the source forward (FLA's Triton path rounds like TF32, ~1e-3 relative, while
ours computes in fp32), in bf16 to each other.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is not installed")

from transformers import AutoModelForCausalLM  # noqa: E402

import hf_hybrid  # noqa: E402,F401
from hf_hybrid.conversion.checkpoint_io import load_state, read_config  # noqa: E402
from hf_hybrid.conversion.fox import convert_to_fox  # noqa: E402
from hf_hybrid.conversion.fox_reference import source_logits_float64  # noqa: E402

VOCAB = 1024


def _fla_model(tmp_path, **overrides):
    config = fla_models.ForgettingTransformerConfig(
        vocab_size=VOCAB, hidden_size=256, num_heads=4, num_hidden_layers=2, intermediate_size=512,
        fuse_cross_entropy=False, **overrides,
    )
    torch.manual_seed(0)
    model = fla_models.ForgettingTransformerForCausalLM(config)
    with torch.no_grad():  # larger-than-init weights so the layers do more than pass the residual on
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0, 0.06)
    model.save_pretrained(tmp_path / "fla")
    return model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 2, "qk_norm": True, "use_output_gate": True}])
def test_fla_checkpoint_converts_with_matching_logits_and_tokens(tmp_path, overrides):
    fla = _fla_model(tmp_path, **overrides)
    convert_to_fox(tmp_path / "fla", tmp_path / "ours", verify_tokens=0)
    ids = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(1)).cuda()

    reference = source_logits_float64(read_config(tmp_path / "fla"), load_state(tmp_path / "fla"), ids.cpu()).cuda()
    fla32 = fla.cuda().float().eval()
    ours32 = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        err_fla, err_ours = _relative(fla32(ids).logits, reference), _relative(ours32(ids).logits, reference)
    print(f"fp32 relative error vs float64: FLA {err_fla:.2e}, hf-hybrid {err_ours:.2e}")
    assert err_ours <= 1e-4 and err_fla <= 5e-3

    # Greedy generate() of both, each judged against the float64 restatement along its own tokens:
    # every step whose float64 top-2 margin exceeds the model's own logit error must pick the float64
    # argmax. Ours computes in fp32 (error ~1e-5); FLA's cached decode kernels round like TF32, so a
    # near-tie can part the two sequences, and only there.
    prompt = ids[:1, :32]
    state, config = load_state(tmp_path / "fla"), read_config(tmp_path / "fla")
    with torch.no_grad():
        ours_out = ours32.generate(prompt, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
        fla_out = fla32.generate(prompt, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
    figures = {}
    for name, out in (("hf-hybrid", ours_out), ("FLA", fla_out)):
        tokens = out.sequences.cpu()
        exact = source_logits_float64(config, state, tokens)[0, prompt.shape[1] - 1 : -1]
        step_logits = torch.cat(out.logits).double().cpu()
        scale = exact.abs().max()
        error = ((step_logits - exact).abs().max() / scale).item()
        top2 = exact.topk(2, dim=-1)
        decisive = (top2.values[:, 0] - top2.values[:, 1]) > 2 * error * scale
        chosen = tokens[0, prompt.shape[1] :]
        figures[name] = (error, int(decisive.sum()))
        assert torch.equal(chosen[decisive], top2.indices[decisive, 0]), f"{name}: greedy tokens are not the float64 argmax"
    same = int((ours_out.sequences == fla_out.sequences)[0, prompt.shape[1] :].cumprod(0).sum())
    print(f"greedy generate(), decode-step logit error vs float64: hf-hybrid {figures['hf-hybrid'][0]:.2e}, FLA "
          f"{figures['FLA'][0]:.2e}; steps with a decisive float64 margin: {figures['hf-hybrid'][1]} / "
          f"{figures['FLA'][1]} of 16; tokens equal for the first {same} of 16")
    assert figures["hf-hybrid"][0] <= 1e-4 and figures["FLA"][0] <= 2e-2
    assert figures["hf-hybrid"][1] >= 14  # ours is exact enough that (almost) every step is decided

    # bf16 last: Module.to() converts the fp32 models above in place.
    fla16, ours16 = fla32.to(torch.bfloat16), ours32.to(torch.bfloat16)
    with torch.no_grad():
        err_bf16 = _relative(ours16(ids).logits, fla16(ids).logits)
    print(f"bf16 relative difference hf-hybrid vs FLA: {err_bf16:.2e}")
    assert err_bf16 <= 2e-2
