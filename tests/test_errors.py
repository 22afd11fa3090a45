"""Front-end errors: class, message, Fix line and the user's file:line with a caret."""

import pickle
import traceback

import numpy as np
import pytest
from mlir.dialects import arith
from source_modules import write_kernel_module

import kiln
from kiln import f32, i32

V = np.zeros(4, np.float32)


def test_verifier_failure_is_compilation_error_at_user_line(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        # addf on i32 passes the builder; only the verifier catches it
        arith.AddFOp(n.ir, n.ir)  # @raw-op

    with pytest.raises(kiln.CompilationError) as info:
        k.trace(V, 1)
    err = info.value
    assert "failed MLIR verification" in err.message and "floating-point" in err.message
    assert err.loc.line == marker_line("@raw-op")
    assert err.loc.filename == __file__
    assert "Fix:" in str(err)


def test_error_message_shows_source_and_caret(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = x[1] ** 1.5  # @pow

    with pytest.raises(kiln.UnsupportedError) as info:
        k.trace(V)
    text = str(info.value)
    line = marker_line("@pow")
    assert text.splitlines()[0].startswith(f"{__file__}:{line}: x ** 1.5")
    assert "x[0] = x[1] ** 1.5" in text.splitlines()[1]
    assert set(text.splitlines()[2].strip()) == {"^"}
    assert text.splitlines()[-1].startswith("Fix: ")


def test_traceback_hides_kiln_frames():
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = kiln.where(x[0], 1.0, 2.0)  # where needs an i1 condition

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V)
    frames = traceback.extract_tb(info.value.__traceback__)
    kiln_frames = [f.filename for f in frames if "/dsl/" in f.filename]
    assert kiln_frames == [kiln.core.errors.__file__]  # only the re-raise in @user_facing


def test_show_stacktrace_keeps_kiln_frames(monkeypatch):
    monkeypatch.setenv("KILN_SHOW_STACKTRACE", "1")

    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = kiln.where(x[0], 1.0, 2.0)

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.filename.endswith("ops.py") for f in frames)


def test_loop_local_used_after_loop_error_pickles_with_location(marker_line):
    @kiln.kernel
    def k2(x: kiln.Tensor[f32], n: i32):
        for j in kiln.range(n):
            inner = x[j]
        x[0] = inner  # @pickled-kiln

    with pytest.raises(kiln.KilnTypeError) as info:
        k2.trace(V, 2)
    err = pickle.loads(pickle.dumps(info.value))
    assert isinstance(err, kiln.KilnTypeError)
    assert err.loc.line == marker_line("@pickled-kiln")
    assert "first assigned inside a kiln.range loop" in err.message


def test_traced_value_as_python_int_is_type_error(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        for j in range(n):  # @py-range
            x[j] = 0.0

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V, 2)
    assert "kiln.range" in info.value.fix
    assert info.value.loc.line == marker_line("@py-range")


def test_bad_tensormap_annotation_is_value_error():
    with pytest.raises(kiln.KilnValueError, match="swizzle"):
        kiln.TensorMap[kiln.f16, (64, 64), 48]


def test_unresolvable_string_annotation_explains_fix():
    def make():
        local_dtype = kiln.f32

        def k(x: "kiln.Tensor[local_dtype]"):
            pass

        return k

    with pytest.raises(kiln.KilnTypeError, match="cannot resolve the annotation") as info:
        kiln.kernel(make())
    assert "module level" in info.value.fix


def test_int_literal_that_does_not_fit_the_operand_dtype(tmp_path):
    """``x_i8 + 1000`` and ``mask & 3`` used to wrap silently; now they are KilnValueErrors."""
    module = write_kernel_module(tmp_path, "literal_range_kernel", """
        import kiln
        from kiln import i8

        @kiln.kernel
        def add_big(x: kiln.Tensor[i8]):
            i = kiln.thread_id(0)
            x[i] = x[i] + 1000
        """)
    with pytest.raises(kiln.KilnValueError, match=r"literal 1000 does not fit i8 \(range -128..255\)") as info:
        module.add_big.trace(np.zeros(4, np.int8), target="sm_90a")
    assert info.value.loc.line == 7 and "Fix:" in str(info.value)


def test_vector_load_on_a_strided_tensor(tmp_path):
    """A width-N load needs a unit innermost stride: a KilnValueError at the load, not MLIR's
    'most minor memref dim must have unit stride'."""
    module = write_kernel_module(tmp_path, "strided_vector_kernel", """
        import kiln
        from kiln import f32

        @kiln.kernel
        def wide(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
            i = kiln.thread_id(0)
            y.store(4 * i, x.load(4 * i, width=4))
        """)
    strided = np.zeros(64, np.float32)[::2]
    with pytest.raises(kiln.KilnValueError, match="needs consecutive elements") as info:
        module.wide.trace(strided, np.zeros(32, np.float32), target="sm_90a")
    assert info.value.loc.line == 7 and "contiguous" in info.value.fix


# ---- Python and numpy code applied to traced values (issue 38) --------------------------------

def _plain_helper(v):
    if v > 0.0:  # @plain-helper-if
        return v
    return -v


def test_math_function_on_traced_value_names_the_kiln_function(marker_line):
    import math

    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = math.exp(x[1])  # @math-exp

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V)
    assert "math.exp() needs a Python number" in info.value.message
    assert "kiln.exp(" in info.value.fix and "kiln.range" not in info.value.fix
    assert info.value.loc.line == marker_line("@math-exp")


def test_float_of_traced_value_suggests_kiln_cast(marker_line):
    import math

    @kiln.kernel
    def k(x: kiln.Tensor[f32], C: kiln.constexpr):
        if C == "float":
            x[0] = float(x[1])  # @float-call
        else:
            x[0] = math.floor(x[1])  # @math-floor

    with pytest.raises(kiln.KilnTypeError, match=r"float\(\) of a traced value") as info:
        k.trace(V, C="float")
    assert "kiln.cast(" in info.value.fix
    assert info.value.loc.line == marker_line("@float-call")
    with pytest.raises(kiln.KilnTypeError, match=r"math.floor\(\) needs a Python number") as info:
        k.trace(V, C="floor")
    assert "Kiln's math" in info.value.fix  # no kiln.floor: the fix lists what exists
    assert info.value.loc.line == marker_line("@math-floor")


def test_numpy_function_on_traced_value_is_kiln_type_error(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = np.exp(x[1])  # @np-exp

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V)
    assert "numpy.exp() cannot take a traced value" in info.value.message
    assert "kiln.exp(" in info.value.fix
    assert info.value.loc.line == marker_line("@np-exp")


def test_numpy_scalar_operand_still_works_like_a_python_literal():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
        i = kiln.thread_id(0)
        y[i] = np.float32(2.0) * x[i] - np.float64(1.0)

    rng = np.random.default_rng(38)
    x = rng.standard_normal(128).astype(np.float32)
    y = np.full(128, np.nan, np.float32)
    k.interpret[1](x, y)
    np.testing.assert_allclose(y, 2.0 * x.astype(np.float64) - 1.0, rtol=1e-6)


def test_while_on_traced_value_points_at_the_while(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        i = 0
        while i < n:  # @traced-while
            i += 1

    with pytest.raises(kiln.UnsupportedError, match="`while` on a traced condition") as info:
        k.trace(V, 3)
    assert info.value.loc.line == marker_line("@traced-while")


def test_if_in_plain_helper_names_kiln_func(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = _plain_helper(x[1])

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V)
    assert "`if` on a traced value in _plain_helper()" in info.value.message
    assert "@kiln.func" in info.value.fix
    assert info.value.loc.line == marker_line("@plain-helper-if")


def _plain_helper_and(a, b):
    return a and b  # @plain-helper-and


def test_and_in_plain_helper_does_not_suggest_kiln_func(marker_line):
    # @kiln.func would not help: `and` on traced values fails there too.
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = _plain_helper_and(x[1] > 0.0, x[2] > 0.0)

    with pytest.raises(kiln.KilnTypeError, match="no Python truth value") as info:
        k.trace(V)
    assert "@kiln.func" not in info.value.fix
    assert info.value.loc.line == marker_line("@plain-helper-and")


def test_interpret_without_grid_says_how_to_index(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = 1.0

    with pytest.raises(kiln.KilnTypeError, match="needs a grid") as info:
        k.interpret(V)  # @interpret-no-grid
    assert "k.interpret[grid](...)" in info.value.fix
    assert info.value.loc.line == marker_line("@interpret-no-grid")


def test_unknown_op_keyword_lists_the_accepted_ones(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x.store(0, x[1], mask=True)  # @bad-keyword

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(V)
    assert "x.store(): got an unexpected keyword argument 'mask'" in info.value.message
    assert info.value.fix == "call it as x.store(*args, align=None)"
    assert info.value.loc.line == marker_line("@bad-keyword")


def test_unknown_keyword_of_a_kiln_function(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[0] = kiln.exp(x[1], approx=True)  # @bad-keyword-fn

    with pytest.raises(kiln.KilnTypeError,
                       match=r"kiln.exp\(\): got an unexpected keyword") as info:
        k.trace(V)
    assert info.value.loc.line == marker_line("@bad-keyword-fn")


def test_formatting_a_traced_value_suggests_kiln_print(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        v = x[1]
        assert repr(v) == "kiln.Value(f32)"  # repr stays available for debugging
        print(f"v = {v}")  # @fstring

    with pytest.raises(kiln.KilnTypeError, match="formatting a traced value") as info:
        k.trace(V)
    assert "kiln.print(" in info.value.fix
    assert info.value.loc.line == marker_line("@fstring")


def test_printing_a_traced_value_suggests_kiln_print(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        print("v =", x[1])  # @print-value

    with pytest.raises(kiln.KilnTypeError, match="formatting a traced value") as info:
        k.trace(V)
    assert info.value.loc.line == marker_line("@print-value")


def test_traced_shared_shape_suggests_constexpr(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], B):
        s = kiln.shared((B,), f32)  # @traced-shape
        s[0] = x[0]

    with pytest.raises(kiln.KilnValueError) as info:
        k.trace(V, 4)
    assert "'B' is a traced value" in info.value.message
    assert "B: kiln.constexpr" in info.value.fix
    assert info.value.loc.line == marker_line("@traced-shape")


def test_raise_under_traced_if_is_a_trace_time_error(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        if n > 3:
            raise ValueError("n too big")  # @traced-raise
        x[0] = 1.0

    with pytest.raises(kiln.UnsupportedError, match="`raise` inside an `if` whose condition is "
                                                    "a traced value") as info:
        k.trace(V, 2)
    assert "kiln.constexpr" in info.value.fix
    assert info.value.loc.line == marker_line("@traced-raise")


def test_raise_under_constexpr_if_still_runs_in_python():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32, BLOCK: kiln.constexpr):
        if BLOCK > 1024:
            raise ValueError("BLOCK too big")
        if n > 0:
            x[0] = 1.0

    k.trace(V, 2, BLOCK=256)
    with pytest.raises(ValueError, match="BLOCK too big"):
        k.trace(V, 2, BLOCK=2048)
