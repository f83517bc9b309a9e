"""Bad input gets a clear exception naming the argument: ValueError for a wrong shape, dtype or
value (the library's flashattn::Error, message kept), TypeError for what is not a tensor;
never a crash. Inputs are left as they were."""

import numpy as np
import pytest

import flashattn
from conftest import requires_torch, torch


def arrays(*shape):
    return np.ones(shape, np.float32)


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="q: expected a numpy.ndarray or a torch.Tensor, got "
                                        "builtins.list"):
        flashattn.flash_attn_func([[1.0]], arrays(1, 1, 1, 1), arrays(1, 1, 1, 1))


def test_library_errors_become_value_errors_with_the_message():
    q = arrays(1, 4, 2, 32)
    with pytest.raises(ValueError, match=r"k: expected head_dim 32 \(as q\), got 16"):
        flashattn.flash_attn_func(q, arrays(1, 4, 2, 16), arrays(1, 4, 2, 16))
    with pytest.raises(ValueError, match="heads"):
        flashattn.flash_attn_func(q, arrays(1, 4, 3, 32), arrays(1, 4, 3, 32))
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        flashattn.flash_attn_func(arrays(4, 2, 32), q, q)
    with pytest.raises(ValueError, match="softmax_scale"):
        flashattn.flash_attn_func(q, q, q, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="window_size"):
        flashattn.flash_attn_func(q, q, q, window_size=3)


def test_mixed_dtypes_and_int_tensors_are_value_errors():
    q = arrays(1, 4, 2, 32)
    with pytest.raises(ValueError, match="dtype"):
        flashattn.flash_attn_func(q, q.astype(np.float16), q)
    with pytest.raises(ValueError, match="q: expected dtype float32, float16 or bfloat16"):
        flashattn.flash_attn_func(q.astype(np.int32), q, q)
    with pytest.raises(ValueError, match="float64"):
        flashattn.flash_attn_func(q.astype(np.float64), q, q)


def test_zero_size_tensors_do_not_crash():
    q = arrays(1, 0, 2, 32)
    k = arrays(1, 5, 2, 32)
    out = flashattn.flash_attn_func(q, k, k)
    assert out.shape == (1, 0, 2, 32)
    out, lse = flashattn.flash_attn_func(arrays(1, 3, 2, 32), arrays(1, 0, 2, 32),
                                         arrays(1, 0, 2, 32), return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_read_only_cache_is_refused_and_untouched():
    k_cache = np.zeros((1, 8, 1, 16), np.float32)
    k_cache.flags.writeable = False
    v_cache = np.zeros((1, 8, 1, 16), np.float32)
    new = np.ones((1, 1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="k_cache: expected a writable array"):
        flashattn.flash_attn_with_kvcache(arrays(1, 1, 1, 16), k_cache, v_cache, new, new,
                                          cache_seqlens=0)
    assert np.all(v_cache == 0)


def test_kvcache_bad_lengths_and_tables_write_nothing():
    k_cache, v_cache = np.zeros((4, 4, 1, 16), np.float32), np.zeros((4, 4, 1, 16), np.float32)
    new = np.ones((1, 1, 1, 16), np.float32)
    q = arrays(1, 1, 1, 16)
    with pytest.raises(ValueError, match="block_table"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=[5],
                                          block_table=np.array([[0, 9]], np.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=[8],
                                          block_table=np.array([[0, 1]], np.int32))
    assert np.all(k_cache == 0) and np.all(v_cache == 0)
    with pytest.raises(ValueError, match="rotary_cos"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=q)


def test_varlen_bad_offsets():
    q = arrays(10, 2, 32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flashattn.flash_attn_varlen_func(q, q, q, [0, 6, 4, 10], [0, 4, 6, 10])
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flashattn.flash_attn_varlen_func(q, q, q, [0, 4, 10], [0.0, 4.0, 10.0])


def test_unsupported_features_say_so():
    q = arrays(1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"dropout_p: expected a value in \[0, 1\)"):
        flashattn.flash_attn_func(q, q, q, 1.0)
    with pytest.raises(ValueError, match="impl"):
        flashattn.flash_attn_func(q, q, q, impl="cuda")


@requires_torch
def test_torch_errors():
    q = torch.ones(1, 4, 2, 32)
    with pytest.raises(ValueError, match="q: expected a CPU tensor, got one on meta"):
        flashattn.flash_attn_func(torch.empty(1, 4, 2, 32, device="meta"), q, q)
    with pytest.raises(TypeError, match="k: expected a torch.Tensor, as q is"):
        flashattn.flash_attn_func(q, q.numpy(), q)
    with pytest.raises(ValueError, match="int64"):
        flashattn.flash_attn_func(q.long(), q, q)
    with pytest.raises(ValueError, match="attn_mask: expected a bool tensor"):
        flashattn.flash_attn_func(q, q, q, attn_mask=torch.ones(4, 4))


def test_multi_head_attention_layer_errors():
    layer = flashattn.MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match="num_heads"):
        flashattn.MultiHeadAttention(32, 5)
    with pytest.raises(ValueError, match="x: expected float32"):
        layer(arrays(2, 3, 16))
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        layer(arrays(2, 3, 32).astype(np.float16))


def test_ctrl_c_during_a_long_call_raises_keyboard_interrupt_after_it(tmp_path):
    # The library runs with the GIL released and cannot be stopped mid-call; the signal is
    # taken when the call returns: KeyboardInterrupt, a clean traceback, no crash.
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "long_call.py"
    script.write_text(
        "import numpy as np, flashattn, sys\n"
        "q = np.ones((1, 4096, 8, 128), np.float32)\n"
        "print('ready', flush=True)\n"
        "try:\n"
        "    while True:\n"
        "        flashattn.flash_attn_func(q, q, q)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(3)\n")
    env = dict(os.environ)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    try:
        out, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 3 and "interrupted" in out
