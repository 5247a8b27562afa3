"""fnscale.analysis.hlo on every spelling XLA writes, each count worked out by hand in the comments.

Replica groups (explicit lists, iota lists with and without transposes, `mesh[...]` lists
with and without `device_ids`), tuple elements as XLA dump files write them (`%param#0`),
GPU library calls (cuBLAS GEMMs, cuDNN convolutions and fused attention), custom kernels,
ragged dots, and what `summarize` reports when it can't read something (among it every
opcode whose work it doesn't count or that it doesn't know). The snippets copy the spelling
of real compiler output (this machine's jax 0.10.2 and 0.12 programs, XLA's own GPU tests).
"""
import pytest

from fnscale.analysis import hlo

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


# libtpu under jax 0.12 (a Llama's embedding lookup on v5p): the gather runs on the
# SparseCore as an asynchronous call whose computations end with their execution thread.
SPARSECORE = """HloModule m, num_partitions=4

%called_computation (p0: bf16[256,512], p1: s32[64]) -> bf16[64,512] {
  %p0 = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[64]{0:T(1024)} parameter(1)
  ROOT %g = bf16[64,512]{1,0:T(8,128)(2,1)} gather(%p0, %p1), offset_dims={1}
}, execution_thread="sparsecore"

%after (x: bf16[64,512], w: bf16[512,8]) -> bf16[64,8] {
  %x = bf16[64,512]{1,0} parameter(0)
  %w = bf16[512,8]{1,0} parameter(1)
  ROOT %d = bf16[64,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (t: bf16[256,512], i: s32[64], w: bf16[512,8]) -> bf16[64,8] {
  %t = bf16[256,512]{1,0} parameter(0)
  %i = s32[64]{0} parameter(1)
  %w = bf16[512,8]{1,0} parameter(2)
  %s = ((), (), (s32[1]{0})) call-start(), async_execution_thread="sparsecore", to_apply=%called_computation
  %u = ((bf16[256,512]{1,0}, s32[64]{0}), bf16[64,512]{1,0}) call-update(%s, %t, %i)
  %e = bf16[64,512]{1,0} call-done(%u)
  %r1 = bf16[64,8]{1,0} call(%e, %w), to_apply=%after
  %r2 = bf16[64,8]{1,0} call(%e, %w), to_apply=%after
  ROOT %r = bf16[64,8]{1,0} add(%r1, %r2)
}
"""


def test_an_asynchronous_call_on_another_thread_is_read():
  s = hlo.summarize(SPARSECORE)
  assert s.unread == hlo.Unread()
  # The dot after the offloaded gather, in a computation called twice: 2 x (2 x 64 x 8 x 512).
  assert s.matmul_flops == 2 * 2 * 64 * 8 * 512
  # Negative control: a reader that ends computations only at "}" runs the next
  # computation's lines into this one's, called once: half the FLOPs.
  legacy = SPARSECORE.replace('}, execution_thread="sparsecore"', '} trailing')
  assert hlo.summarize(legacy).matmul_flops == 2 * 64 * 8 * 512


def test_an_async_collective_fusion_counts_the_collective_it_wraps():
  # libtpu (0.0.42.1) around an FSDP all-gather of a layer's bf16[512,512] weight over 4
  # chips, compiled for a v5e:2x2: the start and done custom calls add no work or traffic;
  # the all-gather sends 3/4 of its 512 KiB result once.
  text = (
      "HloModule g, num_partitions=4\n"
      "  %all-gather.26 = bf16[1,512,512]{2,1,0} all-gather(%p), channel_id=27, "
      "replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}, "
      "use_global_device_ids=true\n"
      "  %custom-call.126 = (bf16[1,128,512]{2,1,0}, bf16[1,512,512]{2,1,0}, s32[2]{0}) "
      "custom-call(%all-gather.26), custom_call_target=\"AsyncCollectiveStart\"\n"
      "  ROOT %custom-call.128 = bf16[1,512,512]{2,1,0} custom-call(%custom-call.126), "
      "custom_call_target=\"AsyncCollectiveDone\"\n")
  s = hlo.summarize(text)
  assert s.unread == hlo.Unread()
  assert [(c.kind, c.ops, c.bytes_sent) for c in s.collectives] == [
      ("all-gather", 1, 3 / 4 * 512 * 512 * 2)]


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


# ----------------------------------------------------------------------------- every opcode

# XLA's three ragged-dot modes, each with its FLOPs by hand (spelling: jax 0.10.2 and 0.12
# lowering `lax.ragged_dot_general` for TPU).
@pytest.mark.parametrize("lhs,rhs,result,dims,flops", [
    # jax.lax.ragged_dot: 12 rows in 3 groups, each row times its group's [8,5]:
    # 2 x 12 x 8 x 5 = 960 (reading the group dim as free would give 3x that).
    ("f32[12,8]", "f32[3,8,5]", "f32[12,5]", "lhs_contracting_dims={1}, "
     "rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}", 960),
    # The same per batch of 2, rhs [group, batch, k, n]: 2 x 2 x 12 x 8 x 5 = 1920.
    ("f32[2,12,8]", "f32[3,2,8,5]", "f32[2,12,5]", "lhs_batch_dims={0}, "
     "lhs_contracting_dims={2}, rhs_batch_dims={1}, rhs_contracting_dims={2}, "
     "lhs_ragged_dims={1}, rhs_group_dims={0}", 1920),
    # Ragged k: [12,8] x [8,5] -> one [12,5] per group, each group multiplying its own slice
    # of k, 2 x 12 x 8 x 5 = 960 in all; dot's 2 x result x k (2 x 180 x 8 = 2880) is 3x over.
    ("f32[12,8]", "f32[8,5]", "f32[3,12,5]", "lhs_contracting_dims={1}, "
     "rhs_contracting_dims={0}, lhs_ragged_dims={1}", 960),
    # Ragged batch: 4 batch rows split into groups, a batched dot: 2 x 4 x 6 x 8 x 5 = 1920.
    ("f32[4,6,8]", "f32[4,8,5]", "f32[4,6,5]", "lhs_batch_dims={0}, "
     "lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, "
     "lhs_ragged_dims={0}", 1920),
])
def test_ragged_dot_flops(lhs, rhs, result, dims, flops):
  # Catches a ragged-dot left uncounted (the reader once gave 0 and "nothing" unread), the
  # group dim counted as an rhs free dim, and dot's formula on a ragged-k result.
  text = _module(f"%x = {lhs} parameter(0)", f"%w = {rhs} parameter(1)",
                 "%g = s32[3]{0} parameter(2)",
                 f"%r = {result} ragged-dot(%x, %w, %g), {dims}",
                 "ROOT %p = f32[] parameter(3)")
  s = hlo.summarize(text)
  assert s.matmul_flops == flops and s.unread == hlo.Unread()
  # An inline operand shape reads the same.
  inline = f"%r = {result} ragged-dot({lhs} %x, {rhs} %w, s32[3] %g), {dims}"
  assert hlo.matmul_flops(inline) == flops


@pytest.mark.parametrize("line", [
    # No shape for the lhs.
    "%r = f32[12,5] ragged-dot(%missing, %w, %g), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}",
    # No ragged dim: XLA always prints one.
    "%r = f32[12,5] ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={1}, rhs_group_dims={0}",
    # No group dim, so the result's rank (2) can't hold rhs's two free dims: the 3 groups
    # would count as a free dim, 3x the work.
    "%r = f32[12,5] ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={1}, lhs_ragged_dims={0}",
    # Contracting 8 against 3.
    "%r = f32[12,8] ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={0}, lhs_ragged_dims={0}, rhs_group_dims={1}",
    # A dim beyond the rhs's rank, and a list not spelled as dims.
    "%r = f32[12,5] ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={3}, lhs_ragged_dims={0}, rhs_group_dims={0}",
    "%r = f32[12,5] ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims=[0]",
])
def test_ragged_dot_that_cant_be_read_is_unread(line):
  # Catches a guess (0, or the group dim as free) where the text doesn't say the work.
  text = _module("%x = f32[12,8]{1,0} parameter(0)", "%w = f32[3,8,5]{2,1,0} parameter(1)",
                 "%g = s32[3]{0} parameter(2)", line, "ROOT %p = f32[] parameter(3)")
  s = hlo.summarize(text)
  assert s.unread == hlo.Unread(ops=(("ragged-dot", 1),)) and s.matmul_flops == 0


def test_work_the_reader_does_not_count_is_unread():
  # Catches a reader that counts a fixed list of opcodes and passes over the rest: an FFT, a
  # triangular solve, a Cholesky factorisation, a block-scaled dot (2 x 4 x 4 x 4 = 128 FLOPs
  # of matmul it doesn't read) and an opcode XLA may add later each count 0 FLOPs, so each is
  # named, once per instruction; the ordinary dot beside them still counts 128.
  text = _module(
      "%a = f32[4,4]{1,0} parameter(0)",
      "%b = f32[4,4]{1,0} parameter(1)",
      "%z = c64[4,4]{1,0} parameter(2)",
      "%f = c64[4,4]{1,0} fft(%z), fft_type=FFT, fft_length={4}",
      "%i = c64[4,4]{1,0} fft(%f), fft_type=IFFT, fft_length={4}",
      "%t = f32[4,4]{1,0} triangular-solve(%a, %b), left_side=true, lower=true, "
      "transpose_a=NO_TRANSPOSE",
      "%c = f32[4,4]{1,0} cholesky(%a), lower=true",
      "%sa = f8e8m0fnu[4,1]{1,0} parameter(3)",
      "%sb = f8e8m0fnu[1,4]{1,0} parameter(4)",
      "%sd = f32[4,4]{1,0} scaled-dot(%a, %b, %sa, %sb), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={0}",
      "%q = f32[4,4]{1,0} quantum-matmul(%a, %b)",
      # An async FFT in XLA's one-instruction spelling is still an FFT.
      "%fs = ((c64[4,4]{1,0}), c64[4,4]{1,0}, s32[]) fft-start(%z), fft_type=FFT, "
      "fft_length={4}",
      "%fd = c64[4,4]{1,0} fft-done(%fs)",
      "%d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
      "ROOT %p = f32[] parameter(5)")
  s = hlo.summarize(text)
  assert s.unread.ops == (("cholesky", 1), ("fft", 2), ("fft-done", 1), ("fft-start", 1),
                          ("quantum-matmul", 1), ("scaled-dot", 1), ("triangular-solve", 1))
  assert s.unread.count == 8 and s.matmul_flops == 128
  assert "2 fft" in str(s.unread) and "1 quantum-matmul" in str(s.unread)


# An ordinary program in the spellings of this machine's CPU and TPU programs: a loop of 3
# trips around a [4,4] x [4,4] dot (2 x 4 x 4 x 4 = 128 FLOPs a trip), elementwise math,
# reductions, sorting, gathers and scatters, random bits, host transfers, async copies and
# slices (the TPU compiler's `slice-start`/`slice-done`) and an async all-reduce of f32[4,4]
# (64 bytes) over 2 partitions.
COMMON = """HloModule common, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%less (p: f32[], q: f32[]) -> pred[] {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %lt = pred[] compare(%p, %q), direction=LT
}

%fused (param_0: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  %two = f32[] constant(2)
  %b2 = f32[4,4]{1,0} broadcast(%two), dimensions={}
  %m = f32[4,4]{1,0} multiply(%param_0, %b2)
  %e = f32[4,4]{1,0} exponential(%m)
  %n = f32[4,4]{1,0} negate(%e)
  %mx = f32[4,4]{1,0} maximum(%n, %param_0)
  %th = f32[4,4]{1,0} tanh(%mx)
  %rs = f32[4,4]{1,0} rsqrt(%e)
  %dv = f32[4,4]{1,0} divide(%th, %rs)
  %cv = bf16[4,4]{1,0} convert(%dv)
  %bc = s16[4,4]{1,0} bitcast-convert(%cv)
  %back = bf16[4,4]{1,0} bitcast-convert(%bc)
  ROOT %f32 = f32[4,4]{1,0} convert(%back)
}

%body (w: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %w = (s32[], f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%w), index=0
  %v = f32[4,4]{1,0} get-tuple-element(%w), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %d = f32[4,4]{1,0} dot(%v, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%next, %d)
}

%cond (c: (s32[], f32[4,4])) -> pred[] {
  %c = (s32[], f32[4,4]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %three = s32[] constant(3)
  ROOT %more = pred[] compare(%ci, %three), direction=LT
}

%then (a0: f32[4,4]) -> f32[4,4] {
  %a0 = f32[4,4]{1,0} parameter(0)
  ROOT %ab = f32[4,4]{1,0} abs(%a0)
}

%else (a1: f32[4,4]) -> f32[4,4] {
  %a1 = f32[4,4]{1,0} parameter(0)
  ROOT %fl = f32[4,4]{1,0} floor(%a1)
}

ENTRY %main (a: f32[4,4], k: u32[2], j: s32[]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0), sharding={replicated}
  %k = u32[2]{0} parameter(1)
  %j = s32[] parameter(2)
  %zero = s32[] constant(0)
  %fz = f32[] constant(0)
  %pid = u32[] partition-id()
  %rid = u32[] replica-id()
  %tok = token[] after-all()
  %fu = f32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%fused
  %init = (s32[], f32[4,4]{1,0}) tuple(%zero, %fu)
  %loop = (s32[], f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %lv = f32[4,4]{1,0} get-tuple-element(%loop), index=1
  %ob = f32[4,4]{1,0} opt-barrier(%lv)
  %red = f32[4]{0} reduce(%ob, %fz), dimensions={1}, to_apply=%add
  %win = f32[4,4]{1,0} reduce-window(%ob, %fz), window={size=1x3 pad=0_0x2_0}, to_apply=%add
  %srt = f32[4,4]{1,0} sort(%win), dimensions={0}, is_stable=true, to_apply=%less
  %tr = f32[4,4]{0,1} transpose(%srt), dimensions={1,0}
  %cp = f32[4,4]{1,0} copy(%tr)
  %rsh = f32[16]{0} reshape(%cp)
  %bt = f32[2,8]{1,0} bitcast(%rsh)
  %sl = f32[2,4]{1,0} slice(%bt), slice={[0:2], [0:4]}
  %cat = f32[4,4]{1,0} concatenate(%sl, %sl), dimensions={0}
  %pd = f32[6,6]{1,0} pad(%cat, %fz), padding=1_1x1_1
  %ds = f32[4,4]{1,0} dynamic-slice(%pd, %j, %j), dynamic_slice_sizes={4,4}
  %dus = f32[6,6]{1,0} dynamic-update-slice(%pd, %ds, %j, %j)
  %io = s32[2,1]{1,0} iota(), iota_dimension=0
  %ga = f32[2,6]{1,0} gather(%dus, %io), offset_dims={1}, collapsed_slice_dims={0}, \
start_index_map={0}, index_vector_dim=1, slice_sizes={1,6}
  %sc = f32[6,6]{1,0} scatter(%dus, %io, %ga), update_window_dims={1}, \
inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  %rv = f32[6,6]{1,0} reverse(%sc), dimensions={0}
  %rng = (u32[2]{0}, u32[4,4]{1,0}) rng-bit-generator(%k), algorithm=rng_default
  %bits = u32[4,4]{1,0} get-tuple-element(%rng), index=1
  %sh = u32[4,4]{1,0} shift-right-logical(%bits, %bits)
  %fb = f32[4,4]{1,0} convert(%sh)
  %cmp = pred[4,4]{1,0} compare(%fb, %lv), direction=GT
  %sel = f32[4,4]{1,0} select(%cmp, %fb, %lv)
  %cl = f32[4,4]{1,0} clamp(%a, %sel, %a)
  %ss = ((f32[6,6]{1,0}), f32[4,4]{1,0}, s32[]) slice-start(%rv), slice={[0:4], [0:4]}
  %sld = f32[4,4]{1,0} slice-done(%ss)
  %mn = f32[4,4]{1,0} minimum(%cl, %sld)
  %cs = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[]) copy-start(%mn)
  %cd = f32[4,4]{1,0} copy-done(%cs)
  %neg = pred[] compare(%j, %zero), direction=LT
  %br = f32[4,4]{1,0} conditional(%neg, %cd, %cd), true_computation=%then, \
false_computation=%else
  %ars = f32[4,4]{1,0} all-reduce-start(%br), channel_id=1, replica_groups={{0,1}}, \
use_global_device_ids=true, to_apply=%add
  %ard = f32[4,4]{1,0} all-reduce-done(%ars)
  %snd = (f32[4,4]{1,0}, u32[], token[]) send(%ard, %tok), channel_id=2, is_host_transfer=true
  %sd = token[] send-done(%snd), channel_id=2, is_host_transfer=true
  %rcv = (f32[4,4]{1,0}, u32[], token[]) recv(%tok), channel_id=3, is_host_transfer=true
  %rd = (f32[4,4]{1,0}, token[]) recv-done(%rcv), channel_id=3, is_host_transfer=true
  %got = f32[4,4]{1,0} get-tuple-element(%rd), index=0
  %sh2 = f32[4,4]{1,0} custom-call(%got), custom_call_target="Sharding", sharding={replicated}
  ROOT %out = f32[4,4]{1,0} add(%sh2, %ard)
}
"""


def test_an_ordinary_program_reads_in_full():
  # Catches a list of known opcodes that misses a common one, spells one as it is not
  # printed (XLA writes `opt-barrier`, not `optimization-barrier`) or misses an async
  # spelling (`slice-start`): that one would be reported unread here and in every compiled
  # program of the suite that holds it.
  s = hlo.summarize(COMMON)
  assert s.unread == hlo.Unread()
  assert s.matmul_flops == 3 * 128 and s.loops == (hlo.Loop("body", 3),)
  # A ring all-reduce over 2 devices sends 2 x 1/2 of its 64 bytes.
  assert s.collective("all-reduce") == hlo.Collective("all-reduce", 1, 64, 1, 64.0)


def _megascale_send(shape: str, kind: str, target: str, n: int) -> str:
  attrs = (f'is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name='
           f'"xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.{n}_0",'
           f'_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{target}",'
           f'_xla_megascale_transfer_type="{kind}"}}')
  return "\n".join([
      f"  %a{n} = token[] after-all()",
      f"  %s{n} = ({shape}, u32[], token[]) send(%x, %a{n}), channel_id={2 * n}, {attrs}",
      f"  %r{n} = ({shape}, u32[], token[]) recv(%a{n}), channel_id={2 * n + 1}, {attrs}",
      f"  %sd{n} = token[] send-done(%s{n}), channel_id={2 * n}, {attrs}",
      f"  %rd{n} = ({shape}, token[]) recv-done(%r{n}), channel_id={2 * n + 1}, {attrs}"])


def test_collectives_across_slices_are_the_megascale_sends():
  # A multi-slice TPU program (libtpu, as in test_hlo's multi-slice test) runs its
  # collectives across slices as host-transfer send/recv pairs of the megascale runtime:
  # each send is one collective over the slices of its target (the recv is its result).
  # Hand counts: bf16[96,8,128] over 2 slices = 196608 bytes, ring 2 (1/2) x that = 196608;
  # f32[1024] over 4 slices ({1:4}, a range) = 4096 bytes, ring 2 (3/4) x 4096 = 6144;
  # ALL_GATHER of f32[2,256] (each slice's shard, 2048 bytes: the result is 3 x that) over
  # slices {1,2,3}, ring 2/3 x 6144 = 2 x 2048.
  # A transfer of a kind not known here, or a target that can't be read, is unread.
  text = "\n".join([
      "HloModule m, num_partitions=4", "", "ENTRY %main (x: bf16[96,8,128]) -> bf16[96,8,128] {",
      "  %x = bf16[96,8,128]{2,1,0} parameter(0)",
      _megascale_send("bf16[96,8,128]{2,1,0:T(8,128)(2,1)}", "ALL_REDUCE", "{1,2}x{0:3}", 1),
      _megascale_send("f32[1024]{0}", "ALL_REDUCE", "{1:4}x{0:3}", 2),
      _megascale_send("f32[2,256]{1,0}", "ALL_GATHER", "{1,2,3}x{0:3}", 3),
      _megascale_send("f32[8]{0}", "BROADCAST_SOMEHOW", "{1,2}x{0:3}", 4),
      _megascale_send("f32[8]{0}", "ALL_REDUCE", "{a,b}", 5),
      "  ROOT %y = bf16[96,8,128]{2,1,0} copy(%x)", "}"])
  s = hlo.summarize(text)
  assert s.dcn_bytes_sent == 196608 + 6144 + 2 * 2048
  assert s.collective("all-reduce") == hlo.Collective("all-reduce", 2, 196608 + 4096, 2,
                                                      196608 + 6144)
  assert s.collective("all-gather").bytes == 3 * 2048
  assert s.groups == (("all-gather", 3, 2.0 * 2048), ("all-reduce", 2, 196608.0),
                      ("all-reduce", 4, 6144.0))
  assert s.dcn_groups == s.groups  # every collective of this module crosses slices
  assert s.unread.ops == (("send ALL_REDUCE", 1), ("send BROADCAST_SOMEHOW", 1))
  # REDUCE_SCATTER sends its whole input: f32[2,256] over 3 slices scatters 2048 / 3 bytes
  # to each, and a device sends 2 of those shards.
  scatter = hlo.summarize(text.replace('"ALL_GATHER"', '"REDUCE_SCATTER"'))
  assert scatter.collective("reduce-scatter").bytes_sent == pytest.approx(2 * 2048 / 3)
  # A ppermute across slices: a ONE_TO_ONE transfer between listed device pairs, each
  # device sending its buffer once (f32[2,64] = 512 bytes); one without pairs is unread.
  pairs = text.replace('"ALL_GATHER"', '"ONE_TO_ONE"').replace(
      '_xla_megascale_target="{1,2,3}x{0:3}"', "_xla_megascale_target={{100000->200000},"
      "{200000->100000}}").replace("f32[2,256]", "f32[2,64]")
  p = hlo.summarize(pairs)
  assert p.collective("collective-permute") == hlo.Collective("collective-permute", 1, 512, 1,
                                                              512.0)
  assert ("collective-permute", 2, 512.0) in p.dcn_groups
  unpaired = hlo.summarize(text.replace('"ALL_GATHER"', '"ONE_TO_ONE"'))
  assert ("send ONE_TO_ONE", 1) in unpaired.unread.ops
  # An all-to-all across slices (libtpu 0.0.42.1, Ulysses attention over a DCN context
  # axis) lists its groups of device ids, slice x 100000 + chip: 2 slices here, each device
  # sending half of its f32[2,256] (2048 bytes).
  groups = text.replace('"ALL_GATHER"', '"ALL_TO_ALL"').replace(
      '_xla_megascale_target="{1,2,3}x{0:3}"', "_xla_megascale_target={{100000,200000},"
      "{100001,200001}}")
  a2a = hlo.summarize(groups)
  assert a2a.collective("all-to-all") == hlo.Collective("all-to-all", 1, 2048, 1, 1024.0)
  assert ("all-to-all", 2, 1024.0) in a2a.dcn_groups
  # Host transfers that are not the megascale runtime's (infeed-like) move no device bytes.
  plain = text.replace('"xla_megascale_runtime"', '"host_callback"')
  assert hlo.summarize(plain).dcn_bytes_sent == 0 and hlo.summarize(plain).collectives == ()
