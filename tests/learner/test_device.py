"""Host memory on a CPU learner: large freed blocks are kept for the next step."""

import json
import subprocess
import sys

import pytest

_STEPS = """
import json, os, resource, sys, torch
if sys.argv[1] == "keep":
    from agent_r1.learner.backend import keep_freed_host_memory
    assert keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_mb():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
out = {"faults": [], "rss": []}
for step in range(12):  # a learner step: its activations and gradients, small tensors between, freed
    before, live = faults(), []
    for mb in (48, 8, 96, 3, 64, 20):
        live += [torch.ones(mb << 20, dtype=torch.uint8), torch.ones(100)]
    del live
    out["faults"].append(faults() - before)
    out["rss"].append(rss_mb())
print(json.dumps(out))
"""


def _steps(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults_and_memory_stays_bounded():
    default, kept = _steps("default"), _steps("keep")
    late = slice(6, 12)  # after the first steps have shaped the heap
    step_pages = (48 + 8 + 96 + 3 + 64 + 20) << 20 >> 12
    # glibc's default: every large block is mmap'd afresh and zero-filled at every step
    assert sum(default["faults"][late]) > 6 * step_pages // 2, default
    # kept: the next steps reuse the same pages (a few refaults while blocks settle)
    assert sum(kept["faults"][late]) < sum(default["faults"][late]) // 8, (kept, default)
    # and the kept memory does not grow step after step (no fragmentation creep): in all, less
    # than two steps' worth above the first step; over the last six steps, at most a block or two
    # settling (an occasional 64 MB one was seen), not one per step
    step_mb = 48 + 8 + 96 + 3 + 64 + 20
    assert kept["rss"][-1] - kept["rss"][0] < 2 * step_mb, kept["rss"]
    assert kept["rss"][-1] - kept["rss"][5] < 2 * 96, kept["rss"]


SCALE = r"""
import json, resource, torch
from megatron.core import utils as mutils
from megatron.core.optimizer import clip_grads, optimizer
from agent_r1.learner.backend import cpu_compat
assert clip_grads.multi_tensor_scale_impl is mutils.local_multi_tensor_scale  # no TE, no apex here
cpu_compat.apply()
out = {"installed": [m.multi_tensor_scale_impl is cpu_compat._scale_into for m in (clip_grads, optimizer)]}
g = torch.Generator().manual_seed(0)
src = [torch.randn(1000, generator=g), torch.randn(37, 5, generator=g)]
same = []
for scale in (1.0, 0.37):
    for dtype in (torch.bfloat16, torch.float32):  # fp32 main weights into bf16 ones; fp32 grads
        a = [torch.empty_like(s, dtype=dtype) for s in src]
        b = [torch.empty_like(s, dtype=dtype) for s in src]
        mutils.local_multi_tensor_scale(0, None, [src, a], scale)
        cpu_compat._scale_into(0, None, [src, b], scale)
        same.append(all(torch.equal(x, y) for x, y in zip(a, b)))
grads = [s.clone() for s in src]  # the clip's call: src and dst the same tensors
cpu_compat._scale_into(0, None, [grads, grads], 0.5)
same.append(all(torch.equal(x, s * 0.5) for x, s in zip(grads, src)))
out["same"] = same
big = [torch.ones(16 << 20)]  # 64 MB: past glibc's mmap threshold, so a temporary is fresh pages
faults = {}
for name, fn in (("megatron", mutils.local_multi_tensor_scale), ("ours", cpu_compat._scale_into)):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        fn(0, None, [big, big], 0.5)
    faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
out["faults"] = faults
print(json.dumps(out))
"""


def test_the_cpu_learners_tensor_scale_writes_in_place():
    """Without Transformer Engine or apex (every CPU), Megatron scales and copies tensor lists
    (the gradient clip; fp32 main weights into the bf16 model after each step) with
    ``local_multi_tensor_scale``, whose ``dst.copy_(src * scale)`` makes a full-size temporary.
    ``cpu_compat.apply`` installs ``_scale_into`` in both places: bit-identical results (into bf16
    and float32, scale 1 and not, src and dst the same tensors) without the temporary's page
    faults (3 calls on a 64 MB tensor: Megatron's faults in >= 3 x 16K pages, ours < 1K)."""
    proc = subprocess.run([sys.executable, "-c", SCALE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"] == [True, True]
    assert all(out["same"]), out["same"]
    assert out["faults"]["megatron"] >= 3 * 16_000, out["faults"]
    assert out["faults"]["ours"] < 1_000, out["faults"]


META = r"""
import json, sys, torch
from agent_r1.learner.backend import cpu_compat
cpu_compat.apply()
from transformers import AutoModelForCausalLM
with torch.device("meta"):
    devices = [str(torch.tensor([1.0]).device), str(torch.zeros(2).device), str(torch.arange(3).device)]
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
print(json.dumps({"devices": devices, "inv_freq": model.model.rotary_emb.inv_freq.tolist()}))
"""


def test_device_contexts_and_hf_loading_still_work_after_the_cpu_patches(tiny_model_dir):
    """``cpu_compat.apply`` wraps torch's factories; ``with torch.device("meta")`` must still move
    them (it recognises factories by identity), or transformers' meta-device init leaves an HF
    model's non-persistent buffers (the rotary inv_freq) as uninitialised memory in any process
    that loads one after the patches (the learner's engine scorer does)."""
    from transformers import AutoConfig

    proc = subprocess.run(
        [sys.executable, "-c", META, str(tiny_model_dir)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == ["meta"] * 3
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
    ref = [1.0 / theta ** (i / head) for i in range(0, head, 2)]  # the default RoPE frequencies
    assert out["inv_freq"] == pytest.approx(ref, rel=1e-6)
