# SGLang >= 0.5.18, positional (array_like) events. Derived by hand from
# python/sglang/srt/disaggregation/kv_events.py as of sgl-project/sglang
# PR #30827 (BlockStoredWithMetadata: the 7 positional fields of BlockStored,
# then the BlockStoredMetadata map at position 7 when the stored node has a
# cache_salt) and PR #37482's first form (session_id in the same map, a
# struct with omit_defaults: absent keys are left out). EventBatch is
# array_like without omit_defaults: attn_dp_rank is always written.
# Block hashes are hash_str_to_int64 of SGLang's page chain (see
# sglang-hashes.json): positive values as msgpack uint64, negative as int64.
93                                    # batch [ts, events, attn_dp_rank]
  cb 3f f8 00 00 00 00 00 00          # ts 1.5
  95                                  # 5 events
    98 ab 'BlockStored'               # salted: 8 elements
      92 cf 00 6f eb 30 6a 14 6e ed   # block_hashes: tenant-a, [1 2] [7 8]
         cf 41 d4 e9 80 98 72 fe 28
      c0                              # parent_block_hash None (root)
      94 01 02 07 08                  # token_ids
      02                              # block_size (--page-size 2)
      c0                              # lora_id None
      a3 'GPU'                        # medium
      81 aa 'cache_salt' a8 'tenant-a'   # position 7: BlockStoredMetadata
    97 ab 'BlockStored'               # unsalted: the legacy 7 elements
      91 cf 34 fb 5c 82 5d e7 ca 4a   # [1 2] unsalted
      c0
      92 01 02
      02
      c0
      a3 'GPU'
    98 ab 'BlockStored'               # salt and session, host tier
      92 cf 46 df 15 fc c0 48 14 60   # tenant-b, [1 2] [7 8]; the second
         d3 b5 ca fc af 9b 8c 35 51   # is negative as an int64
      c0
      94 01 02 07 08
      02
      c0
      a9 'CPU_TIER1'
      82 aa 'cache_salt' a8 'tenant-b' aa 'session_id' a6 'sess-7'
    98 ab 'BlockStored'               # session only, below the unsalted block
      91 cf 0b fa 9b 9c 6f d7 27 c7   # [7 8] after unsalted [1 2]
      cf 34 fb 5c 82 5d e7 ca 4a      # parent: [1 2] unsalted
      92 07 08
      02
      c0
      a3 'GPU'
      81 aa 'session_id' a6 'sess-9'
    93 ac 'BlockRemoved'              # type, block_hashes, medium
      91 cf 41 d4 e9 80 98 72 fe 28
      a9 'CPU_TIER2'
  00                                  # attn_dp_rank 0
