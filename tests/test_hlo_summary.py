"""fnscale.analysis.hlo.summarize on small hand-written HLO: the counts a reader must get exactly."""
import pytest

from fnscale.analysis import hlo
from fnscale import StepError

# Two dots (one with two contracting dims) and a reduce-scatter over groups of 4, no loop.
FLAT = """HloModule flat, replica_count=1, num_partitions=8

ENTRY %main (a: f32[4,6], b: f32[6,5], c: bf16[2,3,7], d: bf16[3,7,9]) -> f32[4,5] {
  %a = f32[4,6]{1,0} parameter(0)
  %b = f32[6,5]{1,0} parameter(1)
  %c = bf16[2,3,7]{2,1,0} parameter(2)
  %d = bf16[3,7,9]{2,1,0} parameter(3)
  %e = f32[4,5]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f = bf16[2,9]{1,0} dot(%c, %d), lhs_contracting_dims={1,2}, rhs_contracting_dims={0,1}
  %g = f32[1,5]{1,0} reduce-scatter(%e), channel_id=1, replica_groups=[2,4]<=[8], \
dimensions={0}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[4,5]{1,0} copy(%e)
}
"""


def test_flat_module_counts_by_hand():
  s = hlo.summarize(FLAT)
  # 2 x result elements x contracted size: 2*4*5*6 and 2*2*9*(3*7).
  assert s.matmul_flops == 2 * 4 * 5 * 6 + 2 * 2 * 9 * 21 == 996
  assert s.matmul_flops_once == s.matmul_flops and s.loops == () and s.num_devices == 8
  (rs,) = s.collectives
  # Result f32[1,5] = 20 bytes; a ring reduce-scatter over 4 devices sends 3 shards.
  assert rs == hlo.Collective("reduce-scatter", 1, 20, 1, 60.0)
  assert s.unknown_trip_counts == 0


def test_missing_kind_is_an_exact_zero_entry():
  s = hlo.summarize(FLAT)
  assert s.collective("reduce-scatter").count == 1
  for kind in ("all-reduce", "all-gather", "all-to-all"):
    assert s.collective(kind) == hlo.Collective(kind, 0, 0, 0, 0.0)
  assert tuple(s.collective(kind)) == (kind, 0, 0, 0, 0.0)


def test_num_devices_from_the_header_or_the_argument():
  assert hlo.summarize("HloModule m, replica_count=2, num_partitions=4\n").num_devices == 8
  assert hlo.summarize("HloModule m\n").num_devices == 1
  assert hlo.summarize(FLAT, num_devices=3).num_devices == 3


@pytest.mark.parametrize("kind,n,expect", [
    ("all-reduce", 4, 2 * 3 / 4 * 100), ("all-gather", 4, 3 / 4 * 100),
    ("all-to-all", 5, 4 / 5 * 100), ("reduce-scatter", 4, 300.0),
    ("collective-permute", 2, 100.0), ("collective-broadcast", 8, 100.0),
    ("all-reduce", 1, 0.0), ("reduce-scatter", 0, 0.0)])
def test_ring_bytes_sent_by_hand(kind, n, expect):
  assert hlo.ring_bytes_sent(kind, 100, n) == pytest.approx(expect, rel=1e-12)


# A while loop whose body does one [4,6] x [6,6] dot (2 * 4 * 6 * 6 = 288 FLOPs) per trip; the
# condition `i < 5` on tuple element 0. {init}, {entry_params} and {while_attrs} vary per test.
LOOP = """HloModule loop, num_partitions=8

%body (p: (s32[], f32[4,6])) -> (s32[], f32[4,6]) {{
  %p = (s32[], f32[4,6]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[4,6]{{1,0}} get-tuple-element(%p), index=1
  %w = f32[6,6]{{1,0}} constant({{...}})
  %d = f32[4,6]{{1,0}} dot(%h, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,6]{{1,0}}) tuple(%j, %d)
}}

%cond (q: (s32[], f32[4,6])) -> pred[] {{
  %q = (s32[], f32[4,6]{{1,0}}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}}

ENTRY %main (a: f32[4,6]) -> f32[4,6] {{
  %a = f32[4,6]{{1,0}} parameter(0)
{entry_params}{init}
  %loop = (s32[], f32[4,6]{{1,0}}) while(%init), condition=%cond, body=%body{while_attrs}
  ROOT %out = f32[4,6]{{1,0}} get-tuple-element(%loop), index=1
}}
"""
ZERO_INIT = ("  %zero = s32[] constant(0)\n"
             "  %init = (s32[], f32[4,6]{1,0}) tuple(%zero, %a)")


def _loop(init=ZERO_INIT, entry_params="", while_attrs=""):
  return LOOP.format(init=init, entry_params=entry_params, while_attrs=while_attrs)


def test_instruction_continued_on_the_next_line_is_read_as_one():
  # backend_config's JSON broken after "known_trip_count": the next line continues the while
  # (joined with a space), so the known count 5 is read from it, not from the condition.
  text = _loop(while_attrs=', backend_config={"known_trip_count":\n{"n":"5"}}')
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", 5, from_condition=False),)
  assert s.matmul_flops == 5 * 288 and s.matmul_flops_once == 288


def test_counter_started_by_a_parameter_counts_from_zero():
  # The counter's initial value is no constant (a parameter): assumed 0, so `i < 5` is 5 trips.
  text = _loop(entry_params="  %i0 = s32[] parameter(1)\n",
               init="  %init = (s32[], f32[4,6]{1,0}) tuple(%i0, %a)")
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", 5, from_condition=True),)
  assert s.matmul_flops == 5 * 288


def test_loop_bound_carried_in_the_state_is_an_unknown_trip_count():
  # `i < n` with n a tuple element (a traced bound): no constant, so the count is unknown and
  # the body counts once.
  text = _loop().replace("%n = s32[] constant(5)",
                         "%n = s32[] get-tuple-element(%q), index=1")
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", None),) and s.unknown_trip_counts == 1
  assert s.matmul_flops == s.matmul_flops_once == 288


def test_loop_whose_computations_are_not_in_the_text():
  # Instruction lines only: the while names a condition and body the snippet lacks; and a
  # truncated while line without them. Both are loops of unknown count, read without error.
  s = hlo.summarize("%w = (s32[], f32[4]{0}) while(%init), condition=%c, body=%b\n"
                    "%v = (s32[], f32[4]{0}) while(%init)\n")
  assert s.loops == (hlo.Loop("b", None), hlo.Loop("?", None))
  assert s.unknown_trip_counts == 2 and s.matmul_flops == 0


def test_narrow_float_types_count_their_bits():
  # f8e4m3fn: 1 byte per element, f4e2m1fn: half a byte, s4: half a byte, c64: 8 bytes.
  snippet = """
  %a = f8e4m3fn[64]{0} all-gather(f8e4m3fn[8]{0} %x), dimensions={0}
  %b = f4e2m1fn[64]{0} all-to-all(f4e2m1fn[64]{0} %y), dimensions={0}
  %c = s4[64]{0} collective-permute(s4[64]{0} %z), source_target_pairs={{0,1}}
  %d = c64[4]{0} all-reduce(c64[4]{0} %w), to_apply=%add
  """
  got = {c.kind: c.bytes for c in hlo.collectives(snippet)}
  assert got == {"all-reduce": 32, "all-gather": 64, "all-to-all": 32, "collective-permute": 32}


def test_replica_group_size_from_each_group_syntax():
  # 8 devices; all-reduce of f32[64] (256 bytes) in groups of 2 sends 2 x 1/2 x 256 = 256
  # bytes; over all 8 it would be 2 x 7/8 x 256 = 448.
  snippet = """HloModule g, num_partitions=8
  %a = f32[64]{0} all-reduce(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %b = f32[64]{0} all-gather(%y), replica_groups=[2,4]<=[8], dimensions={0}
  %c = f32[64]{0} all-to-all(%z), replica_groups=mesh['data'=2,'model'=4]{'data'}
  %d = f32[64]{0} all-reduce(%w), to_apply=%add
  """
  # all-gather over 4: 3/4 x 256 = 192; all-to-all over 'data' (2): 1/2 x 256 = 128.
  assert hlo.summarize(snippet).groups == (
      ("all-gather", 4, 192.0), ("all-reduce", 2, 256.0), ("all-reduce", 8, 448.0),
      ("all-to-all", 2, 128.0))


def test_async_collective_keeps_the_group_of_its_start():
  snippet = """HloModule g, num_partitions=8
  %s = ((f32[64]{0}), f32[64]{0}) all-reduce-start(%x), replica_groups=[4,2]<=[8], to_apply=%add
  %d = f32[64]{0} all-reduce-done(((f32[64]{0}), f32[64]{0}) %s)
  """
  s = hlo.summarize(snippet)
  # Groups of 2 (from the -start), result 256 bytes: 2 x 1/2 x 256 sent; counted once.
  assert s.collectives == (hlo.Collective("all-reduce", 1, 256, 1, 256.0),)
  assert s.groups == (("all-reduce", 2, 256.0),)


# Dots reached through a call, an async call (start and done name the same computation) and
# both branches of a conditional, each counted once per run.
CALLS = """HloModule calls

%f (x: f32[4,6], y: f32[6,5]) -> f32[4,5] {
  %x = f32[4,6]{1,0} parameter(0)
  %y = f32[6,5]{1,0} parameter(1)
  ROOT %d = f32[4,5]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%g (x: f32[2,3], y: f32[3,4]) -> f32[2,4] {
  %x = f32[2,3]{1,0} parameter(0)
  %y = f32[3,4]{1,0} parameter(1)
  ROOT %d = f32[2,4]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%br0 (x: f32[4,6], y: f32[6,5]) -> f32[4,5] {
  %x = f32[4,6]{1,0} parameter(0)
  %y = f32[6,5]{1,0} parameter(1)
  ROOT %d = f32[4,5]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%br1 (x: f32[4,3], y: f32[3,5]) -> f32[4,5] {
  %x = f32[4,3]{1,0} parameter(0)
  %y = f32[3,5]{1,0} parameter(1)
  ROOT %d = f32[4,5]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%dead (x: f32[8]) -> f32[64] {
  %x = f32[8]{0} parameter(0)
  ROOT %ag = f32[64]{0} all-gather(%x), dimensions={0}
}

ENTRY %main (a: f32[4,6], b: f32[6,5], c: f32[2,3], e: f32[3,4], p: pred[]) -> f32[4,5] {
  %a = f32[4,6]{1,0} parameter(0)
  %b = f32[6,5]{1,0} parameter(1)
  %c = f32[2,3]{1,0} parameter(2)
  %e = f32[3,4]{1,0} parameter(3)
  %p = pred[] parameter(4)
  %call = f32[4,5]{1,0} call(%a, %b), to_apply=%f
  %s = ((f32[2,3]{1,0}, f32[3,4]{1,0}), f32[2,4]{1,0}) async-start(%c, %e), calls=%g
  %u = f32[2,4]{1,0} async-done(%s), calls=%g
  %t = (f32[4,6]{1,0}, f32[6,5]{1,0}) tuple(%a, %b)
  ROOT %k = f32[4,5]{1,0} conditional(%p, %t, %t), branch_computations={%br0, %br1}
}
"""


def test_called_async_and_branch_computations_count_once_each():
  s = hlo.summarize(CALLS)
  # f: 2*4*5*6 = 240; g (async pair, once): 2*2*4*3 = 48; br0: 240; br1: 2*4*5*3 = 120.
  assert s.matmul_flops == 240 + 48 + 240 + 120 == 648
  assert s.matmul_flops_once == 648
  # %dead is called by nothing: its all-gather is not part of the step.
  assert s.collectives == () and s.collective("all-gather").ops == 0


@pytest.mark.parametrize("window,in_size,out_size,taps", [
    # Stride 2 over 5 inputs, pad 1: outputs read inputs {-1,0,1}, {1,2,3}, {3,4,5}: 2+3+2.
    ("size=3 stride=2 pad=1_1", 5, 3, 7),
    # Inputs dilated by 2 (a transposed conv): 3 inputs at 0, 2, 4 of 5; pad 1, 5 outputs
    # each see the even positions among o-1..o+1: 1+2+1+2+1.
    ("size=3 pad=1_1 lhs_dilate=2", 3, 5, 7),
    # Window dilated by 2 over 7 inputs, pad 2: output o reads o-2, o, o+2: 2+2+3+3+3+2+2.
    ("size=3 pad=2_2 rhs_dilate=2", 7, 7, 17),
])
def test_convolution_window_stride_and_dilations(window, in_size, out_size, taps):
  line = (f"%y = f32[1,{out_size},3]{{2,1,0}} convolution(f32[1,{in_size},2]{{2,1,0}} %x, "
          f"f32[3,2,3]{{2,1,0}} %k), window={{{window}}}, dim_labels=b0f_0io->b0f")
  # Each (output position, tap on an input) pair: 2 input x 3 output features multiply-adds.
  assert hlo.matmul_flops(line) == 2 * taps * 2 * 3


def test_convolution_without_readable_dim_labels_counts_nothing():
  line = ("%y = f32[1,3,3]{2,1,0} convolution(f32[1,5,2]{2,1,0} %x, f32[3,2,3]{2,1,0} %k), "
          "window={size=3}")
  assert hlo.matmul_flops(line) == 0
  # Input labels without a feature dim "f": no contracted size to read, so no count either.
  assert hlo.matmul_flops(line + ", dim_labels=b01_0io->b0f") == 0


def test_flops_ratio_by_hand_and_its_errors():
  assert hlo.flops_ratio(_loop(), 720) == 5 * 288 / 720 == 2.0
  for bad in (0, -1.0, float("nan"), True, "1440"):
    with pytest.raises(StepError, match=rf"model_flops={bad!r}, expected a positive "
                       r"number of FLOPs per device per step"):
      hlo.flops_ratio(_loop(), bad)


def test_loop_that_never_runs_counts_no_body():
  # The counter starts at 5 and `i < 5` is false at once: 0 trips, the body's dot never runs.
  text = _loop(init="  %five = s32[] constant(5)\n"
               "  %init = (s32[], f32[4,6]{1,0}) tuple(%five, %a)")
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", 0, from_condition=True),)
  assert s.matmul_flops == 0 and s.matmul_flops_once == 0
  known = hlo.summarize(_loop(while_attrs=', backend_config={"known_trip_count":{"n":"0"}}'))
  assert known.loops == (hlo.Loop("body", 0),) and known.matmul_flops == 0


def test_condition_written_bound_greater_than_counter():
  # `5 > i` (direction=GT, bound first) is the same loop as `i < 5`: 5 trips.
  text = _loop().replace("compare(%k, %n), direction=LT", "compare(%n, %k), direction=GT")
  assert hlo.summarize(text).loops == (hlo.Loop("body", 5, from_condition=True),)
  # A compare without a direction is not read as a bound: unknown, counted once.
  text = _loop().replace("compare(%k, %n), direction=LT", "compare(%k, %n)")
  assert hlo.summarize(text).loops == (hlo.Loop("body", None),)


def test_pred_elements_are_one_byte():
  s = hlo.summarize("%a = pred[64]{0} all-reduce(pred[64]{0} %x), to_apply=%or\n")
  assert s.collective("all-reduce").bytes == 64


def test_convolution_without_a_window_is_one_tap_per_output():
  # No window attribute: a 1x1 convolution, each of 5 outputs reads 1 input position.
  line = ("%y = f32[1,5,3]{2,1,0} convolution(f32[1,5,2]{2,1,0} %x, f32[1,2,3]{2,1,0} %k), "
          "dim_labels=b0f_0io->b0f")
  assert hlo.matmul_flops(line) == 2 * 5 * 2 * 3


def test_flops_ratio_accepts_model_flops_below_one():
  assert hlo.flops_ratio(_loop(), 0.5) == 5 * 288 / 0.5


def test_depthwise_convolution_divides_features_by_groups():
  # feature_group_count=4 over 4 input features: each output channel reads 1 input channel.
  # Window 3, pad 1 over 5 positions: 2 + 3 + 3 + 3 + 2 = 13 taps on the input, 4 channels.
  line = ("%y = f32[1,5,4]{2,1,0} convolution(f32[1,5,4]{2,1,0} %x, f32[3,1,4]{2,1,0} %k), "
          "window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f, feature_group_count=4")
  assert hlo.matmul_flops(line) == 2 * 13 * 4


def _caller(name: str, callee: str) -> str:
  return (f"%{name} (x: f32[4,6], y: f32[6,5]) -> f32[4,5] {{\n"
          "  %x = f32[4,6]{1,0} parameter(0)\n"
          "  %y = f32[6,5]{1,0} parameter(1)\n"
          f"  ROOT %c = f32[4,5]{{1,0}} call(%x, %y), to_apply=%{callee}\n}}\n\n")


# ENTRY calls %a and %b, both call %g, which calls %h (one [4,6] x [6,5] dot): %h runs twice.
DIAMOND = ("HloModule diamond, num_partitions=1\n\n"
           "%h (x: f32[4,6], y: f32[6,5]) -> f32[4,5] {\n"
           "  %x = f32[4,6]{1,0} parameter(0)\n"
           "  %y = f32[6,5]{1,0} parameter(1)\n"
           "  ROOT %d = f32[4,5]{1,0} dot(%x, %y), lhs_contracting_dims={1}, "
           "rhs_contracting_dims={0}\n}\n\n"
           + _caller("g", "h") + _caller("a", "g") + _caller("b", "g") +
           "ENTRY %main (x: f32[4,6], y: f32[6,5]) -> f32[4,5] {\n"
           "  %x = f32[4,6]{1,0} parameter(0)\n"
           "  %y = f32[6,5]{1,0} parameter(1)\n"
           "  %ca = f32[4,5]{1,0} call(%x, %y), to_apply=%a\n"
           "  ROOT %cb = f32[4,5]{1,0} call(%x, %y), to_apply=%b\n}\n")


def test_computation_reached_through_two_callers_counts_both_paths():
  # A count that visits %g after only one of its callers would give %h one run.
  assert hlo.summarize(DIAMOND).matmul_flops == 2 * (2 * 4 * 5 * 6) == 480
