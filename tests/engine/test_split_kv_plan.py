"""Tile sizing of the split-KV attention plans (pure Python: runs in CI without Triton)."""

from engine.attention.split_kv_plan import DEFAULT_CONFIGS, Tile, fit_shared_memory

H200_SMEM = 232448  # shared_memory_per_block_optin on sm_90


def test_tuned_bf16_tiles_are_kept_on_the_h200():
    for config in DEFAULT_CONFIGS.values():
        assert fit_shared_memory(config, 128 * 2, H200_SMEM) == config


def test_fp32_or_wide_heads_shrink_to_fit():
    decode = DEFAULT_CONFIGS["decode"]  # 3 stages of 128 keys
    fp32 = fit_shared_memory(decode, 128 * 4, H200_SMEM)
    assert (fp32.num_stages, fp32.block_n) == (2, 64)
    wide = fit_shared_memory(DEFAULT_CONFIGS["deterministic"], 256 * 2, 101376)  # sm_89-sized
    assert wide.block_n < 128 and wide.block_m == 16
    # the tile follows: block_n and the q-block height come from the fitted config
    tile = Tile.build(DEFAULT_CONFIGS["deterministic"], group=4, split=256, kv_row_bytes=512,
                      smem_limit=H200_SMEM)
    assert tile.block_n == 64 and tile.config.block_n == 64
    assert Tile.build(DEFAULT_CONFIGS["deterministic"], group=4, split=256).block_n == 128



def test_deterministic_extend_keeps_the_decode_tiles_keys_a_step(monkeypatch):
    """The taller prefill tile serves deterministic mode only while it reads as many keys a step
    as the decode tile (its arithmetic); where shared memory shrinks one and not the other, the
    extend plan runs the decode tile itself."""
    import engine.attention.split_kv_plan as skp

    extend, decode = DEFAULT_CONFIGS["deterministic_extend"], DEFAULT_CONFIGS["deterministic"]
    assert extend.block_n == decode.block_n and extend.block_m > decode.block_m
    assert skp.SplitKvPlan(extend, 256, keys_config=decode).tile(4, 256).config == extend  # measured: 8B's heads
    assert skp.SplitKvPlan(extend, 256, keys_config=decode).tile(2, 256).config == extend  # and 0.6B's
    for group, row in ((8, 256), (4, 128), (4, None)):  # not measured: the decode tile
        assert skp.SplitKvPlan(extend, 256, keys_config=decode).tile(group, row).config == decode, (group, row)
    # head_dim 256 in bf16 (512-byte rows): 16 rows of 128 keys fit this limit, 32 rows do not
    limit = 285000
    assert Tile.build(decode, 4, 256, 512, limit).block_n == 128
    assert Tile.build(extend, 4, 256, 512, limit).block_n == 64
    monkeypatch.setattr(skp, "shared_memory_limit", lambda device: limit)
    skp.DET_EXTEND_MEASURED.add((4, 512))  # as if measured there too: the keys a step still decide
    try:
        tile = skp.SplitKvPlan(extend, 256, keys_config=decode).tile(4, 512, device="any")
    finally:
        skp.DET_EXTEND_MEASURED.discard((4, 512))
    assert tile.config.block_m == decode.block_m and tile.block_n == 128
    assert skp.SplitKvPlan(extend, 256).tile(4, 512, device="any").block_n == 64  # no twin: as fitted


def test_a_deterministic_tile_of_ones_own_serves_prefill_too():
    """configs={"deterministic": ...} alone: prefill runs that tile, not the default 32-row one."""
    from engine.attention.split_kv_plan import KernelConfig
    from engine.attention.triton import TritonAttentionBackend

    mine = KernelConfig(block_m=16, block_n=64, num_warps=8, num_stages=2, fp_fusion=False)
    backend = TritonAttentionBackend(deterministic=True, configs={"deterministic": mine})
    assert backend.extend_config == backend.decode_config == mine
