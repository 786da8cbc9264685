# vLLM v0.26.0, one prefill of Qwen3-8B with --kv-events-config
# '{"enable_kv_cache_events":true,"topic":"kv-events"}': a batch reported,
# decoded with msgspec, in volcano-sh/kthena issue #1535 and re-encoded here
# by hand as msgspec writes it (dict order is wire order): tagged-map events
# in the array batch [ts, events, data_parallel_rank], fields with a default
# left out when equal to it (kv_cache_spec_sliding_window), the others
# written even when None.
93
  cb 41 da a8 db e0 35 9f e7            # ts 1789095808.8378847
  91
    8b a4 'type' ab 'BlockStored'
       ac 'block_hashes' 91 cf da b8 9b aa 7b 58 57 c0
       b1 'parent_block_hash' c0
       a9 'token_ids' dc 00 10
          ce 00 02 50 5c cd 03 68 cc c6 cd 23 68 cd 01 76 cd 01 17 cd 1a 42 cd 01 3b
          cd 15 f0 1e ce 00 02 50 5d cc c6 ce 00 02 50 5c ce 00 01 2d 23 cc c6 ce 00 02 50 73
       aa 'block_size' 10
       a7 'lora_id' c0
       a6 'medium' a3 'GPU'
       a9 'lora_name' c0
       aa 'extra_keys' 91 c0
       a9 'group_idx' 00
       b2 'kv_cache_spec_kind' ae 'full_attention'
  00                                    # data_parallel_rank 0
