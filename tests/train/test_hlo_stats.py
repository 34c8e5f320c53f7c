"""coder.train.aot.hlo_stats on three spellings of compiled TPU programs that long-context and
offload layouts produce (hand-written HLO in the form XLA prints): collectives behind
`called_computations=` (offloaded to the SparseCore), a loop whose first iteration XLA peeled,
and host-offload slices and updates of a host-resident buffer."""
from coder.train.aot import hlo_stats

ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def _loop(init: int, bound: int, body_ops: str, carried: str = "f32[4096]{0}") -> str:
    """An entry running `body_ops` (which read %x and define %y, of type `carried`) in a while
    loop whose counter starts at `init` and runs while i < `bound`."""
    return ADD + f"""
%body (p: (s32[], {carried})) -> (s32[], {carried}) {{
  %p = (s32[], {carried}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = {carried} get-tuple-element(%p), index=1
{body_ops}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], {carried}) tuple(%next, %y)
}}

%cond (p: (s32[], {carried})) -> pred[] {{
  %p = (s32[], {carried}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant({bound})
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (x0: {carried}) -> (s32[], {carried}) {{
  %x0 = {carried} parameter(0)
  %start = s32[] constant({init})
  %init = (s32[], {carried}) tuple(%start, %x0)
  ROOT %loop = (s32[], {carried}) while(%init), condition=%cond, body=%body
}}
"""


def test_a_peeled_loop_runs_one_trip_fewer():
    """XLA peeled the first iteration: the counter enters at 1, so `i < 12` runs 11 trips (a
    loop entering at 0 runs 12; both read from the init tuple's constant)."""
    body = "  %y = f32[4096]{0} multiply(%x, %x)"
    for init, trips in ((0, 12), (1, 11)):
        module = hlo_stats.parse_hlo(_loop(init, 12, body))
        runs, unknown = hlo_stats.multiplicities(module)
        assert unknown == [] and runs["body"] == trips and runs["cond"] == trips, (init, runs)


SPARSECORE = """
%sc_reduce_scatter (q: f32[4096]) -> f32[1024] {
  %q = f32[4096]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[1024]{0} reduce-scatter(%q), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}, execution_thread="sparsecore"
"""


def test_a_collective_behind_called_computations_counts_once_per_trip():
    """A reduce-scatter offloaded to the SparseCore (a custom-call whose work sits behind
    `called_computations=`) in a loop of 6 trips: executed 6 times, counted once in the HLO;
    its HBM bytes are the wrapper's operand and result, not charged again inside."""
    body = ("  %rs = f32[1024]{0} custom-call(%x), custom_call_target=\"SparseCoreCollective\", "
            "called_computations={%sc_reduce_scatter}\n"
            "  %pad = f32[] constant(0)\n"
            "  %y = f32[4096]{0} pad(%rs, %pad), padding=0_3072")
    text = _loop(0, 6, body).replace("\n%body", SPARSECORE + "\n%body", 1)
    module = hlo_stats.parse_hlo(text)
    assert ("called", "sc_reduce_scatter") in hlo_stats.callees(
        next(i for i in module.computations["body"] if i.name == "rs"))
    runs, _ = hlo_stats.multiplicities(module)
    assert runs["sc_reduce_scatter"] == 6
    stats = hlo_stats.collective_stats(module, runs, num_devices=4)
    rs = stats["reduce-scatter"]
    assert (rs["count"], rs["executed"], rs["bytes"]) == (1, 6.0, 6 * 4096.0)
    assert rs["wire_bytes"] == 6 * 4096.0 * 3  # (n - 1) times its scattered result
    traffic = {(c, i.name): b for c, i, b in hlo_stats.instruction_traffic(module)}
    assert traffic[("body", "rs")] == 4 * 4096 + 4 * 1024  # reads the operand, writes the result
    assert not any(c == "sc_reduce_scatter" for c, _ in traffic)


HOST_OFFLOAD = """
%fetch (h: f32[64,1024], i: s32[], z: s32[]) -> f32[1,1024] {
  %h = f32[64,1024]{1,0:T(8,128)S(5)} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] parameter(2)
  ROOT %ds = f32[1,1024]{1,0:T(8,128)} dynamic-slice(%h, %i, %z), dynamic_slice_sizes={1,1024}
}

%store (h: f32[64,1024], u: f32[1,1024], i: s32[], z: s32[]) -> f32[64,1024] {
  %h = f32[64,1024]{1,0:T(8,128)S(5)} parameter(0)
  %u = f32[1,1024]{1,0:T(8,128)} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] parameter(3)
  ROOT %dus = f32[64,1024]{1,0:T(8,128)S(5)} dynamic-update-slice(%h, %u, %i, %z)
}

ENTRY %main (host: f32[64,1024], i: s32[]) -> f32[64,1024] {
  %host = f32[64,1024]{1,0:T(8,128)S(5)} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %fetch-start = ((f32[64,1024]{1,0:T(8,128)S(5)}, s32[], s32[]), f32[1,1024]{1,0:T(8,128)}, u32[]) async-start(%host, %i, %z), calls=%fetch
  %fetch-done = f32[1,1024]{1,0:T(8,128)} async-done(%fetch-start)
  %row = f32[1,1024]{1,0:T(8,128)} multiply(%fetch-done, %fetch-done)
  %store-start = ((f32[64,1024]{1,0:T(8,128)S(5)}, f32[1,1024]{1,0:T(8,128)}, s32[], s32[]), f32[64,1024]{1,0:T(8,128)S(5)}, u32[]) async-start(%host, %row, %i, %z), calls=%store
  ROOT %store-done = f32[64,1024]{1,0:T(8,128)S(5)} async-done(%store-start)
}
"""


def test_host_offload_moves_the_slice_not_the_host_buffer_through_hbm():
    """A row fetched from a host-resident [64, 1024] buffer, squared, and stored back: HBM sees
    the row written by the fetch, read and written by the multiply, read by the store; the
    256 KiB host buffer never (the async wrappers' tuples repeat it: they are bookkeeping)."""
    module = hlo_stats.parse_hlo(HOST_OFFLOAD)
    row = 4 * 1024
    assert hlo_stats.hbm_bytes("f32[64,1024]{1,0:T(8,128)S(5)}") == 0
    assert hlo_stats.hbm_bytes("f32[64,1024]{1,0:T(8,128)}") == hlo_stats.nbytes("f32[64,1024]") == 64 * row
    traffic = {(c, i.name): b for c, i, b in hlo_stats.instruction_traffic(module)}
    indices = 2 * 4  # the two s32 offsets each slice op reads
    assert traffic == {("fetch", "ds"): row + indices, ("store", "dus"): row + indices,
                       ("main", "row"): 3 * row}, traffic
    runs, _ = hlo_stats.multiplicities(module)
    assert runs["fetch"] == runs["store"] == 1


SCATTER = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_scatter (c: f32[64,1024], idx: s32[2,1], upd: f32[2,1024]) -> f32[64,1024] {
  %c = f32[64,1024]{1,0} parameter(0)
  %idx = s32[2,1]{1,0} parameter(1)
  %upd = f32[2,1024]{1,0} parameter(2)
  ROOT %sc = f32[64,1024]{1,0} scatter(%c, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (cache: f32[64,1024], idx: s32[2,1], upd: f32[2,1024]) -> f32[64,1024] {
  %cache = f32[64,1024]{1,0} parameter(0)
  %idx = s32[2,1]{1,0} parameter(1)
  %upd = f32[2,1024]{1,0} parameter(2)
  %top = f32[64,1024]{1,0} scatter(%cache, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  ROOT %fused = f32[64,1024]{1,0} fusion(%top, %idx, %upd), kind=kLoop, calls=%fused_scatter
}
"""


def test_a_scatter_writes_its_updates_in_place():
    """Two rows scattered into a [64, 1024] cache, as a top-level scatter and as a fusion's root:
    each reads the indices and the updates and writes the updates; the cache is not read or
    written whole (XLA shares its buffer; a copy it could not avoid is an instruction of its own)."""
    module = hlo_stats.parse_hlo(SCATTER)
    traffic = {(c, i.name): b for c, i, b in hlo_stats.instruction_traffic(module) if c == "main"}
    rows, indices = 2 * 4 * 1024, 2 * 4
    assert traffic == {("main", "top"): 2 * rows + indices, ("main", "fused"): 2 * rows + indices}, traffic


NESTED_SLICE = """
%slice_row (c: f32[64,1024], i: s32[]) -> f32[1,1024] {
  %c = f32[64,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%c, %i, %z), dynamic_slice_sizes={1,1024}
}

%row_times_w (c: f32[64,1024], w: f32[1024,8], i: s32[]) -> f32[1,8] {
  %c = f32[64,1024]{1,0} parameter(0)
  %w = f32[1024,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %row = f32[1,1024]{1,0} fusion(%c, %i), kind=kLoop, calls=%slice_row
  ROOT %dot = f32[1,8]{1,0} dot(%row, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (cache: f32[64,1024], w: f32[1024,8], i: s32[]) -> f32[1,8] {
  %cache = f32[64,1024]{1,0} parameter(0)
  %w = f32[1024,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %out = f32[1,8]{1,0} fusion(%cache, %w, %i), kind=kOutput, calls=%row_times_w
}
"""


def test_a_slice_in_a_nested_fusion_reads_the_slice():
    """A dot whose operand is one row of a [64, 1024] cache, sliced in a fusion nested in the
    dot's (as XLA:TPU fuses a blockwise attention's block of the cache): the row is read, not the
    cache."""
    module = hlo_stats.parse_hlo(NESTED_SLICE)
    traffic = {(c, i.name): b for c, i, b in hlo_stats.instruction_traffic(module) if c == "main"}
    row, w, index, out = 4 * 1024, 4 * 1024 * 8, 4, 4 * 8
    assert traffic == {("main", "out"): row + w + index + out}, traffic


def test_a_conditional_runs_one_branch_a_time():
    """Each of a conditional's k branches counts 1/k of its caller's runs (ring attention's
    hop-dependent block: every device runs one of two equal branches), inside a loop too."""
    import jax
    import jax.numpy as jnp

    def f(x, flag):
        def body(i, x):
            return jax.lax.cond(flag > i, lambda x: x @ x, lambda x: x @ x.T, x)
        return jax.lax.fori_loop(0, 4, body, x)

    text = jax.jit(f).lower(jnp.ones((8, 8)), 2).compile().as_text()
    module = hlo_stats.parse_hlo(text)
    runs, unknown = hlo_stats.multiplicities(module)
    assert not unknown
    branch_runs = [runs[name] for comp in module.computations.values() for ins in comp
                   if ins.opcode == "conditional" for role, name in hlo_stats.callees(ins) if role == "branch"]
    assert branch_runs == [2.0, 2.0]  # 4 trips x 1/2
