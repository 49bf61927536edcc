"""The CPU platform layer: bridges megatron-core's CUDA assumptions, and only when CUDA is absent."""

from unittest import mock

import pytest
import torch

from megatron_rlhf.distributed import platform


@pytest.fixture
def fresh_platform():
    platform.remove_platform()
    yield
    platform.remove_platform()


def test_noop_when_cuda_is_available(fresh_platform):
    originals = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
                 torch.cuda.manual_seed)
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_originals = (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state)
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        assert platform.apply_platform() is False
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
            torch.cuda.manual_seed) == originals
    assert (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state) == mcore_originals
    assert not isinstance(torch.overrides._get_current_function_mode(), platform.CudaToCpuMode)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")  # untouched: CUDA requests still go to CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cuda_requests_become_cpu(fresh_platform):
    assert platform.apply_platform() is True
    assert platform.apply_platform() is True  # idempotent
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_megatron_rng_tracker_forks_cpu_generator(fresh_platform):
    platform.apply_platform()
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-rng", 123)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with tracker.fork("test-rng"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream restored
    with tracker.fork("test-rng"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the tracked stream advanced
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), first)  # and it is the seeded CPU generator
    tracker.reset()


def test_remove_restores_everything(fresh_platform):
    original = torch.cuda.current_device
    if platform.apply_platform():
        assert torch.cuda.current_device is not original
    platform.remove_platform()
    assert torch.cuda.current_device is original


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_bridge_suspended_runs_plain_torch_and_restores_the_bridge(fresh_platform):
    with platform.bridge_suspended():  # nothing installed: a no-op
        assert torch.ones(1).type() == "torch.FloatTensor"
    platform.apply_platform()
    with pytest.raises(RuntimeError):
        with platform.bridge_suspended():
            assert not isinstance(torch.overrides._get_current_function_mode(), platform.CudaToCpuMode)
            assert torch.ones(1).type() == "torch.FloatTensor"
            raise RuntimeError("the bridge must come back after an error too")
    assert isinstance(torch.overrides._get_current_function_mode(), platform.CudaToCpuMode)
    assert torch.empty(1, device="cuda").device.type == "cpu"
    with torch.device("cpu"):  # a mode entered after the bridge: the bridge is not set aside
        with platform.bridge_suspended():
            assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert isinstance(torch.overrides._get_current_function_mode(), platform.CudaToCpuMode)


class _AsksForTheDeviceInBackward(torch.autograd.Function):
    """As megatron's _AllToAll / gather backward: a buffer on the current CUDA device."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, device=torch.cuda.current_device())
        return out.copy_(grad * 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_custom_backward_runs_under_the_bridge(fresh_platform):
    """The autograd engine does not carry the caller's TorchFunctionMode into a custom
    Function's backward; the bridge re-enters it (EP all-to-all, SP, recompute need this)."""
    platform.apply_platform()
    x = torch.ones(3, requires_grad=True)
    _AsksForTheDeviceInBackward.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_streams_and_events_are_no_ops_on_cpu(fresh_platform):
    platform.apply_platform()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        stream.record_event().synchronize()
    from megatron.core.transformer.moe import moe_utils

    sizes = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True)
    assert sizes.tolist() == [2, 3] and not torch.is_tensor(sizes)


def test_local_layers_without_te_build_what_megatron_refuses(fresh_platform):
    """MoE router, torch norm under sequence parallel, CheckpointWithoutOutput(fp8=False)."""
    platform.apply_platform()
    if platform.has_transformer_engine():
        pytest.skip("Transformer Engine present: the local-layer fixes are not applied")
    from types import SimpleNamespace

    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    assert moe_utils.te_general_gemm is None
    assert CheckpointWithoutOutput(fp8=False).fp8 is False
    config = SimpleNamespace(sequence_parallel=True, normalization="RMSNorm", memory_efficient_layer_norm=False,
                             layernorm_zero_centered_gamma=False, persist_layer_norm=False)
    norm = WrappedTorchNorm(config, 8, 1e-6)
    assert config.sequence_parallel and all(p.sequence_parallel for p in norm.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_megatron_imports_on_cpu_without_torch_compile_and_runs_its_fused_functions_eagerly():
    """Its first import under the platform pulls in neither TorchDynamo nor Inductor (2 s of every
    rank's start), a fused function is the plain function, and wandb still imports for our logger."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.util\n"
        "from megatron_rlhf.distributed.platform import apply_platform\n"
        "apply_platform()\n"
        "import megatron.core.models.gpt, megatron.core.transformer.moe.router as router\n"
        "import megatron.core.jit as jit\n"
        "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
        "assert 'torch._dynamo' not in sys.modules and 'torch._inductor' not in sys.modules\n"
        "assert jit.jit_fuser is jit.noop_decorator\n"
        "assert type(bias_gelu).__name__ == 'function', type(bias_gelu)\n"
        "assert type(router.TopKRouter._apply_expert_bias).__name__ == 'function'\n"
        "if importlib.util.find_spec('wandb') is not None:\n"
        "    import wandb; assert wandb.__name__ == 'wandb'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
