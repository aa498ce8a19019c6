"""verl 0.9.1's fused-kernel path with the backend "fgrpo" (fgrpo_kernels.integrations.verl)
against verl's own torch backend: a tiny Qwen2, verl's monkey patch and verl's FSDP engine code
that turns the model's output into per-token log-probs and entropies (`prepare_model_inputs`,
the patched forward, `prepare_model_outputs`), packed (rmpad) and padded, fp32, 1e-5.

Needs verl: run in the venv of bench/verl_env.sh (`FGRPO_REQUIRE_VERL=1 .venv-verl/bin/python -m
pytest tests/test_verl_head.py`; the variable turns the skip without verl into a failure);
tests/test_verl_adapter.py covers the module without verl.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from .verl_guard import need_verl

need_verl()

import verl.utils.tensordict_utils as tu  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from verl.models.transformers import monkey_patch  # noqa: E402
from verl.utils.experimental import torch_functional  # noqa: E402
from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

from fgrpo_kernels.integrations.verl import BACKEND, use_fused_head  # noqa: E402

VOCAB = 97
LENGTHS = [5, 11, 1, 8]  # one sequence of a single token
TEMPERATURE = 0.7


class VerlKernelCalled(AssertionError):
    pass


def _trap(*args, **kwargs):
    raise VerlKernelCalled("verl's own kernel ran")


@pytest.fixture(scope="module")
def model():
    use_fused_head()
    return _tiny_qwen2()


def _tiny_qwen2():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).float()


def _engine(module):
    """verl's FSDP engine with only what its log-prob code reads (no FSDP, no device, no Ray)."""
    engine = object.__new__(FSDPEngineWithLMHead)
    engine.module, engine.pad_to_length, engine.use_ulysses_sp = module, False, False
    return engine


def _micro_batch(rmpad: bool, entropy: bool = True):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    batch = TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "position_ids": torch.nested.nested_tensor(
                [torch.arange(n) for n in LENGTHS], layout=torch.jagged
            ),
        },
        batch_size=[len(LENGTHS)],
    )
    tu.assign_non_tensor(
        batch,
        use_remove_padding=rmpad,
        use_fused_kernels=True,
        calculate_entropy=entropy,
        temperature=TEMPERATURE,
        pad_token_id=0,
    )
    return batch


def _verl_logprobs(model, backend: str, rmpad: bool, monkeypatch, shard=None):
    """verl's per-token log-probs and entropies [total_tokens] for `backend`, and the gradients
    of Σ a·logp + Σ b·entropy (fixed random a, b) in every parameter; `shard(model)` after the
    monkey patch (verl's order)."""
    model = copy.deepcopy(model)
    monkey_patch.apply_monkey_patch(
        model, use_remove_padding=rmpad, use_fused_kernels=True, fused_kernels_backend=backend
    )
    if shard is not None:
        shard(model)
    with monkeypatch.context() as m:
        if backend == BACKEND:  # neither of verl's kernels may run
            m.setattr(LinearCrossEntropy, "forward", staticmethod(_trap))
            m.setattr(torch_functional.FusedLinearForPPOFunction, "forward", staticmethod(_trap))
        engine = _engine(model)
        batch = _micro_batch(rmpad)
        inputs, args = engine.prepare_model_inputs(batch)
        out = engine.prepare_model_outputs(model(**inputs, use_cache=False), args, batch, None)
    logp, ent = out["log_probs"].values(), out["entropy"].values()
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(logp.shape, generator=g) for _ in range(2))
    ((a * logp).sum() + (b * ent).sum()).backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return logp.detach(), ent.detach(), grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(label, got, want, tol=1e-5):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{label}: relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_fgrpo_backend_equals_verls_torch_backend(model, rmpad, monkeypatch):
    logp, ent, grads = _verl_logprobs(model, BACKEND, rmpad, monkeypatch)
    want_logp, want_ent, want_grads = _verl_logprobs(model, "torch", rmpad, monkeypatch)
    assert logp.shape == (sum(LENGTHS),) and ent.shape == logp.shape
    _close("logp", logp, want_logp)
    _close("entropy", ent, want_ent)
    assert want_grads["lm_head.weight"].abs().max() > 0
    for name, want in want_grads.items():
        _close(f"d{name}", grads[name], want)


def test_rmpad_equals_padded_with_our_backend(model, monkeypatch):
    # the same positions but each sequence's last, whose rolled label differs (the next
    # sequence's first token packed, this sequence's first padded; verl masks it out)
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    keep[torch.tensor(LENGTHS).cumsum(0) - 1] = False
    packed = _verl_logprobs(model, BACKEND, True, monkeypatch)
    padded = _verl_logprobs(model, BACKEND, False, monkeypatch)
    _close("logp rmpad vs padded", packed[0][keep], padded[0][keep])
    _close("entropy rmpad vs padded", packed[1], padded[1])


def test_triton_backend_stays_verls(model, monkeypatch):
    net = copy.deepcopy(model)
    monkey_patch.apply_monkey_patch(net, use_fused_kernels=True, fused_kernels_backend="triton")
    monkeypatch.setattr(LinearCrossEntropy, "forward", staticmethod(_trap))
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(VerlKernelCalled):
        net(input_ids=ids, temperature=1.0, return_dict=True)


def test_fgrpo_without_use_fused_kernels_is_refused(model):
    net = copy.deepcopy(model)
    with pytest.raises(ValueError, match="use_fused_kernels: expected True"):
        monkey_patch.apply_monkey_patch(net, use_fused_kernels=False, fused_kernels_backend=BACKEND)


def test_vocabulary_mismatch_is_refused(model):
    net = copy.deepcopy(model)
    monkey_patch.apply_monkey_patch(net, use_fused_kernels=True, fused_kernels_backend=BACKEND)
    ids = torch.randint(0, VOCAB, (1, 6))
    labels = ids.clone()
    labels[0, 2] = VOCAB  # an id the lm_head does not have
    with pytest.raises(ValueError, match=rf"targets: expected ids in \[0, {VOCAB}\)"):
        net(input_ids=ids, shift_labels=labels, temperature=1.0, return_dict=True)


def test_use_fused_head_is_idempotent(model):
    from verl.utils.kernel import linear_cross_entropy as verl_lce

    before = (monkey_patch.patch_forward_with_backends, verl_lce.linear_cross_entropy)
    use_fused_head()
    assert (monkey_patch.patch_forward_with_backends, verl_lce.linear_cross_entropy) == before


def test_external_lib_turns_the_backend_on_in_a_fresh_worker():
    # what each verl worker does with actor_rollout_ref.model.external_lib (HFModelConfig)
    code = (
        "from verl.utils.import_utils import import_external_libs\n"
        "from verl.models.transformers import monkey_patch\n"
        "assert not hasattr(monkey_patch.patch_forward_with_backends, '_fgrpo')\n"
        "import_external_libs('fgrpo_kernels.integrations.verl_enable')\n"
        "assert monkey_patch.patch_forward_with_backends._fgrpo\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _fsdp2_ranks(rank, world, want):
    """verl's own FSDP2 wrapping (apply_fsdp2: each decoder layer, embed_tokens and the untied
    lm_head are their own units, so the patched root forward sees lm_head.weight as a sharded
    DTensor), the backend "fgrpo", the whole batch on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.fsdp_utils import apply_fsdp2

    use_fused_head()
    mesh = init_device_mesh("cpu", (world,))

    def shard(model):
        apply_fsdp2(model, {"mesh": mesh}, {})
        assert hasattr(model.lm_head.weight, "full_tensor"), "lm_head.weight is not a DTensor"

    with pytest.MonkeyPatch.context() as m:
        logp, ent, grads = _verl_logprobs(_tiny_qwen2(), BACKEND, True, m, shard)
    _close("FSDP2 logp", logp, want[0])
    _close("FSDP2 entropy", ent, want[1])
    for name, g in want[2].items():  # each rank holds the whole batch: the average is the full
        _close(f"FSDP2 d{name}", grads[name], g)


def test_fsdp2_dtensor_lm_head_equals_verls_torch_backend(model, monkeypatch):
    from tests.ranks import run_ranks

    want = _verl_logprobs(model, "torch", True, monkeypatch)
    run_ranks(_fsdp2_ranks, 2, want, torch_holds_group=True)
