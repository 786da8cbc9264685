# SGLang after sgl-project/sglang PR #37482 (merged; see issue #38561):
# events are tagged msgpack maps ({"type": <class name>, field: value, ...}
# in declaration order) and cache_salt and session_id are optional fields of
# BlockStored itself, written as nil when unset (no omit_defaults). The
# batch stays the array [ts, events, attn_dp_rank]. Derived by hand from
# those PRs' descriptions: the merged source is not in our reference copy.
93
  cb 3f f8 00 00 00 00 00 00          # ts 1.5
  94
    89 a4 'type' ab 'BlockStored'     # salted, with a session
       ac 'block_hashes' 92 cf 00 6f eb 30 6a 14 6e ed cf 41 d4 e9 80 98 72 fe 28
       b1 'parent_block_hash' c0
       a9 'token_ids' 94 01 02 07 08
       aa 'block_size' 02
       a7 'lora_id' c0
       a6 'medium' a3 'GPU'
       aa 'cache_salt' a8 'tenant-a'
       aa 'session_id' a6 'sess-7'
    89 a4 'type' ab 'BlockStored'     # unsalted: both nil
       ac 'block_hashes' 91 cf 34 fb 5c 82 5d e7 ca 4a
       b1 'parent_block_hash' c0
       a9 'token_ids' 92 01 02
       aa 'block_size' 02
       a7 'lora_id' c0
       a6 'medium' a3 'GPU'
       aa 'cache_salt' c0
       aa 'session_id' c0
    83 a4 'type' ac 'BlockRemoved'
       ac 'block_hashes' 91 d3 b5 ca fc af 9b 8c 35 51
       a6 'medium' a9 'CPU_TIER2'
    81 a4 'type' b0 'AllBlocksCleared'
  01                                  # attn_dp_rank 1
