"""The native kernels' build leaves the process's floating point alone."""

import numpy as np
import torch


def test_loading_every_kernel_keeps_subnormal_floats():
    """Linking with -ffast-math would add crtfastmath.o, which sets flush-to-zero for the whole
    process when a library loads: subnormals would become 0 in torch and numpy (hypothesis refuses
    to run then). Every kernel loads here, and subnormal arithmetic still works."""
    from agent_r1 import native

    names = sorted(p.stem for p in native.HERE.glob("*.cpp"))
    assert {"decode_attention", "main_grad", "swiglu"} <= set(names), names
    for name in names:
        assert native.load(name) is not None, name
    tiny = np.finfo(np.float32).smallest_subnormal
    assert np.float32(tiny) * np.float32(1.0) > 0
    assert float(torch.tensor(tiny, dtype=torch.float32) * 1.0) > 0
    assert float(torch.tensor(1e-40, dtype=torch.float32) + 0.0) != 0.0


def test_a_build_for_another_cpu_is_its_own_library(tmp_path, monkeypatch):
    """``AGENT_R1_NATIVE_MARCH=haswell`` (an AVX2-only machine's code on a newer one) builds another
    library than ``-march=native`` and does not reuse it; a CPU name the compiler does not know is
    refused with the compiler's message."""
    import pytest

    from agent_r1 import native

    monkeypatch.setenv("AGENT_R1_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("AGENT_R1_NATIVE_MARCH", raising=False)
    here = native.build("rms_norm")
    monkeypatch.setenv("AGENT_R1_NATIVE_MARCH", "haswell")
    haswell = native.build("rms_norm")
    assert here != haswell and {here, haswell} == set(tmp_path.glob("rms_norm-*.so"))
    monkeypatch.setenv("AGENT_R1_NATIVE_MARCH", "no-such-cpu")
    with pytest.raises(OSError, match="no-such-cpu"):
        native.build("rms_norm")
