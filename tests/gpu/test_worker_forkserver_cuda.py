"""Tensor-parallel workers are forks of a forkserver that has imported torch, the runner and its kernels
(voltllm/distributed/executor.py, WORKER_PRELOAD). A fork can use CUDA only if its parent never initialised it, so
this checks, on one GPU, that a process started from that forkserver gets a working CUDA context: a matmul, a Triton
kernel of ours against torch, and a one-rank NCCL group's all-reduce."""
import pytest
import torch

from voltllm.distributed.executor import _worker_context

pytestmark = pytest.mark.gpu


def _in_worker(conn) -> None:
    try:
        from voltllm.distributed.group import TPGroup, make_store
        from voltllm.kernels.argmax import row_argmax

        inherited = torch.cuda.is_initialized()  # a fork of a CUDA-initialised parent would say True (or fail below)
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        x = torch.randn(64, 4096, device=dev, dtype=torch.float16)
        mm = (x.float() @ x.float().T).diagonal().sub(x.float().pow(2).sum(-1)).abs().max().item()
        want = torch.randn(8, 50_000, device=dev, dtype=torch.float16)
        got = row_argmax(want)
        group = TPGroup(0, 1, make_store(0, 1, 0), dev)
        t = torch.arange(4, device=dev, dtype=torch.float32)
        group.all_reduce_(t)
        torch.cuda.synchronize()
        conn.send(("ok", inherited, mm, torch.equal(got.cpu(), want.argmax(-1).cpu()), t.cpu().tolist()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(e).__name__}: {e}"))


def test_a_forkserver_worker_uses_cuda_triton_and_nccl():
    ctx = _worker_context()
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_in_worker, args=(theirs,))
    p.start()
    theirs.close()
    assert ours.poll(300), "the worker sent nothing"
    msg = ours.recv()
    p.join(30)
    assert msg[0] == "ok", msg
    _, inherited, mm_err, argmax_equal, reduced = msg
    assert not inherited
    assert mm_err < 1.0
    assert argmax_equal
    assert reduced == [0.0, 1.0, 2.0, 3.0]
    assert p.exitcode == 0
