"""fnscale.hlo on every spelling XLA writes, each count worked out by hand in the comments.

Replica groups (explicit lists, iota lists with and without transposes, `mesh[...]` lists
with and without `device_ids`), tuple elements as XLA dump files write them (`%param#0`),
GPU library calls (cuBLAS GEMMs, cuDNN convolutions and fused attention), custom kernels,
and what `summarize` reports when it can't read something. The snippets copy the spelling
of real compiler output (this machine's jax 0.10.2 and 0.12 programs, XLA's own GPU tests).
"""
import pytest

from fnscale import hlo

# ----------------------------------------------------------------------------- replica groups


def _gather(groups: str) -> str:
  """An 8-partition module with one all-gather of f32[64] (256 bytes) under `groups`."""
  attrs = f", {groups}" if groups else ""
  return ("HloModule g, num_partitions=8\n"
          f"  %ag = f32[64]{{0}} all-gather(f32[8]{{0}} %x), channel_id=1{attrs}, "
          "dimensions={0}, use_global_device_ids=true\n")


@pytest.mark.parametrize("groups,n", [
    # No groups, or an empty list: every device of the module (8 partitions).
    ("", 8),
    ("replica_groups={}", 8),
    # Explicit lists: the size of a group.
    ("replica_groups={{0,2,4,6},{1,3,5,7}}", 4),
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", 2),
    # Iota lists [groups, size]<=[reshape]T(perm): the size is the second number.
    ("replica_groups=[2,4]<=[8]", 4),
    ("replica_groups=[4,2]<=[4,2]T(1,0)", 2),
    ("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", 2),
    # jax 0.12 (named axes, device order implied): the product of the listed axes' sizes.
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}", 4),
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'data'}", 2),
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'data','fsdp'}", 8),
    ("replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'tensor'}", 2),
    # jax 0.10.2 on a data=2,fsdp=4 mesh: XLA's axes and a device order; fsdp is axis_1 here.
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_1'}", 4),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=1,'axis_4'=2], "
     "device_ids=([2,4]T(1,0)) {'axis_4'}", 2),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(2,1,0)) "
     "{'axis_1'}", 2),
    # XLA's printer after jax 0.12: names unquoted, and a sub-axis name:(pre-size)size.
    ("replica_groups=mesh[data=2,fsdp=4] {fsdp}", 4),
    ("replica_groups=mesh[fsdp=8] {fsdp:(2)4}", 4),
    # No axes: groups of one device, nothing sent.
    ("replica_groups=mesh['data'=2,'fsdp'=4] {}", 1),
])
def test_replica_group_spellings(groups, n):
  s = hlo.summarize(_gather(groups))
  # A ring all-gather over n devices sends (n - 1) / n of its 256-byte result.
  sent = (n - 1) / n * 256
  assert s.collective("all-gather") == hlo.Collective("all-gather", 1, 256, 1, sent)
  assert s.groups == ((("all-gather", n, sent),) if n > 1 else ())
  assert s.unread.count == 0


def test_fsdp_all_gather_of_a_jax_0_10_data2_fsdp4_program():
  # The first all-gather of the nano step's layer loop as jax 0.10.2 writes it on a
  # data=2,fsdp=4 mesh: f32[64,3,4,16] (49152 bytes) gathered over axis_0, the 4 fsdp devices.
  # Ring: 3/4 x 49152 = 36864 bytes sent; read as all 8 devices it was 7/8 x 49152 = 43008.
  text = ("HloModule jit_step, num_partitions=8\n"
          "  %all-gather = f32[64,3,4,16]{3,2,1,0} all-gather(%dynamic-slice_bitcast_fusion.1), "
          "channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=1,"
          "'axis_4'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, "
          "use_global_device_ids=true, metadata={op_name=\"jit(step)/dot_general\"}\n")
  s = hlo.summarize(text)
  assert s.collective("all-gather").bytes_sent == 36864 == 3 / 4 * 64 * 3 * 4 * 16 * 4
  assert s.groups == (("all-gather", 4, 36864.0),)


def test_group_mode_cross_replica_and_partition():
  # With a channel_id and no use_global_device_ids=true, an all-reduce lists replicas and
  # spans every partition of each: {{0}} of 1 replica x 4 partitions is a group of 4;
  # without a channel_id it lists replicas only: {{0,1}} of 2 replicas is 2.
  text = ("HloModule m, replica_count=2, num_partitions=4\n"
          "  %a = f32[64]{0} all-reduce(%x), channel_id=1, replica_groups={{0}}, to_apply=%s\n"
          "  %b = f32[64]{0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%s\n")
  # all-reduce of 256 bytes: 2 (n - 1) / n x 256 = 384 over 4, 256 over 2.
  assert hlo.summarize(text).groups == (("all-reduce", 2, 256.0), ("all-reduce", 4, 384.0))


def test_guessed_groups_are_reported():
  # An axis the mesh doesn't name, and text without a module header: both span "every
  # device" by guess (8 from the header; 1 without one), and say so.
  s = hlo.summarize(_gather("replica_groups=mesh['data'=2,'fsdp'=4] {'tensor'}"))
  assert s.groups == (("all-gather", 8, 7 / 8 * 256),)
  assert s.unread == hlo.Unread(groups=(("all-gather", 1),))
  bare = hlo.summarize("%ar = f32[64]{0} all-reduce(f32[64]{0} %x), to_apply=%add\n")
  assert bare.unread.groups == (("all-reduce", 1),) and bare.unread.count == 1
  # The caller's device count is no guess.
  given = hlo.summarize("%ar = f32[64]{0} all-reduce(f32[64]{0} %x), to_apply=%add\n", 4)
  assert given.unread.count == 0 and given.groups == (("all-reduce", 4, 384.0),)


def test_async_pair_keeps_a_mesh_group_of_its_start():
  # jax 0.10.2 spelling on the -start; the -done carries no groups. 2 x 1/2 x 256 sent.
  text = ("HloModule g, num_partitions=8\n"
          "  %s = ((f32[64]{0}), f32[64]{0}) all-reduce-start(%x), channel_id=2, "
          "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, "
          "use_global_device_ids=true, to_apply=%add\n"
          "  %d = f32[64]{0} all-reduce-done(%s)\n")
  assert hlo.summarize(text).groups == (("all-reduce", 2, 256.0),)


# ----------------------------------------------------------------------------- dump files

# A loop as an XLA dump file writes it (jax 0.12, `--xla_dump_to`): no get-tuple-element
# instructions, tuple elements as `%param#k`, and (XLA's CPU backend) the compare and the
# counter's increment in one-op fusions. No known_trip_count: the count comes from `i < 5`.
DUMP_LOOP = """HloModule loop, num_partitions=8

%add.f32 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_add_computation (param_0.1: s32[], param_1.1: s32[]) -> s32[] {
  %param_0.1 = s32[] parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %add.1 = s32[] add(%param_0.1, %param_1.1)
}

%wrapped_compare_computation (param_0: s32[], param_1: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %compare.1 = pred[] compare(%param_0, %param_1), direction=LT
}

%body (param: (s32[], f32[16,32], f32[32,32])) -> (s32[], f32[16,32], f32[32,32]) {
  %param = (s32[], f32[16,32]{1,0}, f32[32,32]{1,0}) parameter(0)
  %copy = s32[] copy(%param#0)
  %one = s32[] constant(1)
  %wrapped_add = s32[] fusion(%copy, %one), kind=kLoop, calls=%wrapped_add_computation
  %dot = f32[16,32]{1,0} dot(%param#1, %param#2), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
  %ar = f32[16,32]{1,0} all-reduce(%dot), channel_id=1, replica_groups=[2,4]<=[8], \
use_global_device_ids=true, to_apply=%add.f32
  ROOT %tuple = (s32[], f32[16,32]{1,0}, f32[32,32]{1,0}) tuple(%wrapped_add, %ar, %param#2)
}

%cond (param.1: (s32[], f32[16,32], f32[32,32])) -> pred[] {
  %param.1 = (s32[], f32[16,32]{1,0}, f32[32,32]{1,0}) parameter(0)
  %n = s32[] constant(5)
  ROOT %wrapped_compare = pred[] fusion(%param.1#0, %n), kind=kLoop, \
calls=%wrapped_compare_computation
}

ENTRY %main (a: f32[16,32], w: f32[32,32]) -> f32[16,32] {
  %a = f32[16,32]{1,0} parameter(0)
  %w = f32[32,32]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,32]{1,0}, f32[32,32]{1,0}) tuple(%zero, %a, %w)
  %while = (s32[], f32[16,32]{1,0}, f32[32,32]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[16,32]{1,0} copy(%while#1)
}
"""


def test_dump_file_tuple_elements_and_condition_count():
  s = hlo.summarize(DUMP_LOOP)
  assert s.loops == (hlo.Loop("body", 5, from_condition=True),)
  # Per trip a [16,32] x [32,32] dot (2 x 16 x 32 x 32 = 32768), its lhs read as element 1
  # of the loop tuple; 5 trips.
  assert s.matmul_flops == 5 * 32768 and s.matmul_flops_once == 32768
  # An all-reduce of 2048 bytes per trip over groups of 4: 2 x 3/4 x 2048 = 3072 sent.
  assert s.collective("all-reduce") == hlo.Collective("all-reduce", 5, 5 * 2048, 1, 5 * 3072.0)
  assert s.unread.count == 0


def test_dump_and_get_tuple_element_spellings_read_the_same():
  # The same program as `Compiled.as_text()` writes it: get-tuple-element instructions.
  gte = (DUMP_LOOP
         .replace("%copy = s32[] copy(%param#0)",
                  "%i = s32[] get-tuple-element(%param), index=0\n  %copy = s32[] copy(%i)")
         .replace("dot(%param#1, %param#2)", "dot(%h, %k)")
         .replace("  %dot =", "  %h = f32[16,32]{1,0} get-tuple-element(%param), index=1\n"
                  "  %k = f32[32,32]{1,0} get-tuple-element(%param), index=2\n  %dot =")
         .replace("tuple(%wrapped_add, %ar, %param#2)", "tuple(%wrapped_add, %ar, %k)")
         .replace("fusion(%param.1#0, %n)", "fusion(%c, %n)")
         .replace("  %n = s32[] constant(5)",
                  "  %c = s32[] get-tuple-element(%param.1), index=0\n  %n = s32[] constant(5)")
         .replace("copy(%while#1)", "copy(%o)")
         .replace("  ROOT %out", "  %o = f32[16,32]{1,0} get-tuple-element(%while), index=1\n"
                  "  ROOT %out"))
  assert "#" not in gte
  assert hlo.summarize(gte) == hlo.summarize(DUMP_LOOP)


def test_counter_increment_and_start_through_fusions():
  # The increment is 2 (an unrolled loop) and the counter starts at 1: ceil((5 - 1) / 2) = 2.
  text = (DUMP_LOOP.replace("%one = s32[] constant(1)", "%one = s32[] constant(2)")
          .replace("%zero = s32[] constant(0)", "%zero = s32[] constant(1)"))
  s = hlo.summarize(text)
  assert s.loops == (hlo.Loop("body", 2, from_condition=True),)
  assert s.matmul_flops == 2 * 32768


# ----------------------------------------------------------------------------- GPU library calls


def _module(*lines: str) -> str:
  return ("HloModule gpu, num_partitions=1\n\nENTRY %main (p: f32[]) -> f32[] {\n"
          + "\n".join(f"  {l}" for l in lines) + "\n}\n")


def _gemm_config(lhs_contract, rhs_contract, lhs_batch="", rhs_batch="", epilogue="DEFAULT"):
  q = lambda dims: ",".join(f'"{d}"' for d in dims)
  return ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
          '"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{'
          f'"lhs_contracting_dimensions":[{q(lhs_contract)}],'
          f'"rhs_contracting_dimensions":[{q(rhs_contract)}],'
          f'"lhs_batch_dimensions":[{q(lhs_batch)}],"rhs_batch_dimensions":[{q(rhs_batch)}]}},'
          '"alpha_imag":0,"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],'
          f'"algorithm":"ALG_UNSET"}},"epilogue":"{epilogue}","lhs_stride":"0",'
          '"rhs_stride":"0","grad_x":false,"grad_y":false,"damax_output":false},'
          '"force_earliest_schedule":false,"reification_cost":[]}')


def test_cublas_gemms():
  text = _module(
      # A transposed lhs as XLA's GPU tests print it: [512,64]^T x [96,512]^T -> [64,96] with
      # a workspace; 2 x 64 x 96 x 512 = 6291456.
      "%a = bf16[512,64]{1,0} parameter(0)",
      "%b = bf16[96,512]{1,0} parameter(1)",
      "%g = (bf16[64,96]{0,1}, s8[4194304]{0}) custom-call(%a, %b), "
      'custom_call_target="__cublas$gemm", ' + _gemm_config("0", "1"),
      # cublasLt with a bias epilogue and a batch dim: 4 x [64,32] x [32,16];
      # 2 x 4 x 64 x 16 x 32 = 262144.
      "%x = f32[4,64,32]{2,1,0} parameter(2)",
      "%y = f32[4,32,16]{2,1,0} parameter(3)",
      "%z = f32[16]{0} parameter(4)",
      "%lt = (f32[4,64,16]{2,1,0}, s8[33554432]{0}) custom-call(%x, %y, %z), "
      'custom_call_target="__cublas$lt$matmul", '
      + _gemm_config("2", "1", "0", "0", epilogue="BIAS"),
      # FP8 with its scales: [64,32] x [16,32]^T -> [64,16]; 2 x 64 x 16 x 32 = 65536.
      "%f = f8e4m3fn[64,32]{1,0} parameter(5)",
      "%h = f8e4m3fn[16,32]{1,0} parameter(6)",
      "%sa = f32[] parameter(7)",
      "%sb = f32[] parameter(8)",
      "%f8 = (bf16[64,16]{1,0}, s8[33554432]{0}) custom-call(%f, %h, %sa, %sb), "
      'custom_call_target="__cublas$lt$matmul$f8", ' + _gemm_config("1", "1"),
      "ROOT %p = f32[] parameter(9)")
  s = hlo.summarize(text)
  assert s.matmul_flops == 6291456 + 262144 + 65536
  assert s.unread.count == 0
  # The same products written as dots read the same.
  dots = _module("%a = bf16[512,64]{1,0} parameter(0)", "%b = bf16[96,512]{1,0} parameter(1)",
                 "%d = bf16[64,96]{1,0} dot(%a, %b), lhs_contracting_dims={0}, "
                 "rhs_contracting_dims={1}", "ROOT %p = f32[] parameter(2)")
  assert hlo.summarize(dots).matmul_flops == 6291456


# A 3x3 "same" convolution over 8x8 images (2 images, 3 -> 5 features): border outputs see
# fewer than 9 pixels, 22 x 22 = 484 (output, tap) pairs land on the input; each multiplies
# 3 input features into 5 outputs: 2 x 2 x 5 x 484 x 3 = 29040 FLOPs.
CONV = "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f"
CUDNN = ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
         '"cudnn_conv_backend_config":{"activation_mode":"kNone","conv_result_scale":1,'
         '"side_input_scale":0,"leakyrelu_alpha":0},"force_earliest_schedule":false}')


@pytest.mark.parametrize("target,operands,result", [
    ("__cudnn$convForward", "%x, %k", "f32[2,8,8,5]{3,2,1,0}"),
    ("__cudnn$convBiasActivationForward", "%x, %k, %bias", "f32[2,8,8,5]{3,2,1,0}"),
    # The gradients are the same multiply-adds: d(input) from (d(output), filter), d(filter)
    # from (input, d(output)); window and labels still describe the forward convolution.
    ("__cudnn$convBackwardInput", "%dy, %k", "f32[2,8,8,3]{3,2,1,0}"),
    ("__cudnn$convBackwardFilter", "%x, %dy", "f32[3,3,3,5]{3,2,1,0}"),
])
def test_cudnn_convolutions(target, operands, result):
  text = _module("%x = f32[2,8,8,3]{3,2,1,0} parameter(0)",
                 "%k = f32[3,3,3,5]{3,2,1,0} parameter(1)",
                 "%dy = f32[2,8,8,5]{3,2,1,0} parameter(2)",
                 "%bias = f32[5]{0} parameter(3)",
                 f"%c = ({result}, u8[0]{{0}}) custom-call({operands}), {CONV}, "
                 f'custom_call_target="{target}", {CUDNN}',
                 "ROOT %p = f32[] parameter(4)")
  assert hlo.summarize(text).matmul_flops == 29040
  plain = _module("%x = f32[2,8,8,3]{3,2,1,0} parameter(0)",
                  "%k = f32[3,3,3,5]{3,2,1,0} parameter(1)",
                  f"ROOT %y = f32[2,8,8,5]{{3,2,1,0}} convolution(%x, %k), {CONV}")
  assert hlo.summarize(plain).matmul_flops == 29040


def _fmha_config(b, h, t, s, backward: bool) -> str:
  dims = ",".join(f'"{d}"' for d in (b, h, t, s))
  gemms = ("bmm1_grad_gemm1", "bmm1_grad_gemm2", "bmm2_grad_gemm1", "bmm2_grad_gemm2"
           ) if backward else ("bmm1", "bmm2")
  numbers = ",".join(f'"{g}_dot_dimension_numbers":{{"lhs_contracting_dimensions":["3"],'
                     '"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],'
                     '"rhs_batch_dimensions":["0","2"]}' for g in gemms)
  return ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
          '"cudnn_fmha_backend_config":{"algorithm":{"algo_id":"0","math_type":"TENSOR_OP_MATH",'
          '"tuning_knobs":{"17":"1","24":"0"},"is_cudnn_frontend":true,"workspace_size":"0"},'
          '"fmha_scale":0.125,"dropout_rate":0,"intermediate_tensor_shape":{"element_type":'
          f'"BF16","dimensions":[{dims}],"tuple_shapes":[],"layout":{{"minor_to_major":'
          '["3","2","1","0"],"tiles":[]},"is_dynamic_dimension":[false,false,false,false]},'
          f'{numbers},"seed":"42","is_flash_attention":true,"mask_type":"CAUSAL",'
          '"force_deterministic":false,"sliding_window_length":0},'
          '"force_earliest_schedule":false}')


def test_cudnn_fused_attention():
  # jax's [batch, seq, heads, head_dim] layout with grouped queries: q [2,16,4,8], k and v
  # [2,16,2,8]; scores P = 2 x 4 x 16 x 16 = 2048 elements. Forward: Q.K^T and P.V, each
  # 2 x 2048 x 8 = 32768. Backward: Q.K^T again, dV = P^T.dO, dP = dO.V^T, dQ = dS.K,
  # dK = dS^T.Q, five of 32768.
  text = _module(
      "%q = bf16[2,16,4,8]{3,2,1,0} parameter(0)",
      "%k = bf16[2,16,2,8]{3,2,1,0} parameter(1)",
      "%v = bf16[2,16,2,8]{3,2,1,0} parameter(2)",
      "%fwd = (bf16[2,16,4,8]{3,1,2,0}, f32[2,4,16]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), "
      'custom_call_target="__cudnn$fmhaSoftmax", ' + _fmha_config(2, 4, 16, 16, False),
      "%stats = f32[2,4,16]{2,1,0} get-tuple-element(%fwd), index=1",
      "%o = bf16[2,16,4,8]{3,2,1,0} get-tuple-element(%fwd), index=0",
      "%do = bf16[2,16,4,8]{3,2,1,0} parameter(3)",
      "%bwd = (bf16[2,16,4,8]{3,2,1,0}, bf16[2,16,2,8]{3,2,1,0}, bf16[2,16,2,8]{3,2,1,0}, "
      "u8[0]{0}) custom-call(%q, %k, %v, %stats, %do, /*index=5*/%o), "
      'custom_call_target="__cudnn$fmhaSoftmaxBackward", ' + _fmha_config(2, 4, 16, 16, True),
      "ROOT %p = f32[] parameter(4)")
  s = hlo.summarize(text)
  assert s.matmul_flops == 2 * 32768 + 5 * 32768
  assert s.unread.count == 0


# ----------------------------------------------------------------------------- kernels, unread


def test_custom_kernels_are_listed_with_their_runs():
  # A Pallas TPU kernel in the loop of 5 trips, declaring 16384 FLOPs per call as jax writes
  # a `pl.CostEstimate` (libtpu's spelling, int64 as a string); a Triton kernel once.
  loop = DUMP_LOOP.replace(
      "  %one = s32[] constant(1)\n",
      "  %one = s32[] constant(1)\n  %fa.3 = f32[16,32]{1,0} custom-call(%param#1), "
      'custom_call_target="tpu_custom_call", backend_config={"flag_configs":[],'
      '"custom_call_config":{"body":"TUxJUgA=","cost_estimate":{"flops":"16384",'
      '"transcendentals":"0","bytes_accessed":"4096","remote_bytes_transferred":"0"},'
      '"needs_layout_passes":true}}\n')
  text = loop.replace(
      "  ROOT %out", "  %tk = f32[16,32]{1,0} custom-call(%a), "
      'custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"add_one"}\n'
      "  ROOT %out")
  s = hlo.summarize(text)
  assert s.kernels == (hlo.Kernel("fa", "tpu_custom_call", 1, 5, 5 * 16384.0),
                       hlo.Kernel("tk", "__gpu$xla.gpu.triton", 1, 1, None))
  # Their work is no matmul here: the loop's dots alone.
  assert s.matmul_flops == 5 * 32768 and s.unread.count == 0


# One of each thing `summarize` can't read, in a module that runs it all once.
UNREAD = """HloModule unread, num_partitions=4

%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %p = (s32[], f32[4,4]{1,0}) parameter(0)
  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%p#0, %p#1)
}

%cond (q: (s32[], f32[4,4])) -> pred[] {
  %q = (s32[], f32[4,4]{1,0}) parameter(0)
  %n = s32[] constant(3)
  ROOT %ne = pred[] compare(%q#0, %n), direction=NE
}

ENTRY %main (a: f32[4,4], t: token[]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %t = token[] parameter(1)
  %u = f32[4,4]{1,0} custom-call(%a, %a), custom_call_target="__onednn$matmul"
  %d = f32[4,4]{1,0} dot(%missing, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %c = f32[4,4]{1,0} convolution(%a, %a), window={size=1}
  %g = (f32[4,4]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm"
  %s = (f32[4,4]{1,0}, u32[], token[]) send(%a, %t), channel_id=3
  %h = (f32[4,4]{1,0}, u32[], token[]) send(%a, %t), channel_id=4, is_host_transfer=true
  %ag = f32[16,4]{1,0} all-gather(%a), channel_id=1, replica_groups=mesh['x'=2,'y'=2] {'z'}, \
dimensions={0}, use_global_device_ids=true
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,4]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[4,4]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,4]{1,0} copy(%ag)
}
"""


def test_what_could_not_be_read_is_returned():
  s = hlo.summarize(UNREAD)
  assert s.unread == hlo.Unread(
      ops=(("convolution", 1), ("custom-call __cublas$gemm", 1),
           ("custom-call __onednn$matmul", 1), ("dot", 1), ("send", 1)),
      loops=("body",), groups=(("all-gather", 1),))
  assert s.unread.count == 7
  assert str(s.unread) == (
      "1 convolution; 1 custom-call __cublas$gemm; 1 custom-call __onednn$matmul; 1 dot; "
      "1 send; 1 loop(s) without a trip count, counted once: body; 1 all-gather with "
      "guessed replica groups (all devices)")
  # Unreadable ops count nothing; the guessed all-gather spans the module's 4 devices.
  assert s.matmul_flops == 0 and s.groups == (("all-gather", 4, 3 / 4 * 256),)
  assert str(hlo.Unread()) == "nothing" and hlo.Unread().count == 0


def test_unread_in_code_that_never_runs_is_not_reported():
  # The same instructions in a computation nothing calls are not part of the step.
  text = UNREAD.replace("ENTRY %main", "%dead").replace(
      "HloModule unread, num_partitions=4\n",
      "HloModule unread, num_partitions=4\n\nENTRY %main (a: f32[4]) -> f32[4] {\n"
      "  ROOT %a = f32[4]{0} parameter(0)\n}\n")
  assert hlo.summarize(text).unread == hlo.Unread()


@pytest.mark.parametrize("text", [DUMP_LOOP, UNREAD], ids=["dump_loop", "unread"])
def test_any_truncated_line_is_read_without_error(text):
  # A text cut short anywhere (a log excerpt, a half-copied line) is read, never raised on.
  lines = text.split("\n")
  for i, line in enumerate(lines):
    for cut in range(0, len(line), 3):
      s = hlo.summarize("\n".join(lines[:i] + [line[:cut]] + lines[i + 1:]))
      assert s.matmul_flops >= 0 and s.unread.count >= 0
