#!/usr/bin/env python3
"""Writes sglang-hashes.json: SGLang's KV-event block hashes for a few
prompts, salted and not, computed with hashlib alone.

What it reproduces (sgl-project/sglang; PR #30827 for the salt):
- each full page of page_size tokens hashes as SHA-256 over the previous
  page's 32-byte digest (none for the first page of an unsalted prompt),
  then every token id as 4 bytes little-endian (get_hash_str in
  python/sglang/srt/mem_cache/utils.py);
- a salted prompt's first page chains from
  SHA-256(b"sglang-cache-salt-v1\\0" + salt.encode("utf-8"))
  (compute_node_event_hash_values, same file);
- the event's block hash is the first 8 bytes of the digest read big-endian,
  as a signed int64 (hash_str_to_int64); "hash" below is its unsigned bits.

Run: python3 sglang_hashes.py > sglang-hashes.json
"""
import hashlib
import json

CASES = [
    # SGLang's own test_salted_events_match_python_hash_and_metadata_contract.
    {"salt": "tenant-a", "page_size": 2, "tokens": [1, 2, 7, 8]},
    {"salt": None, "page_size": 2, "tokens": [1, 2, 7, 8]},
    {"salt": "tenant-b", "page_size": 2, "tokens": [1, 2, 7, 8]},
    {"salt": "租户-ß", "page_size": 4, "tokens": [151643, 65536, 0, 4294967295, 9, 8, 7, 6]},
    {"salt": "tenant-a", "page_size": 16, "tokens": list(range(1000, 1040))},
]


def page_hashes(salt, page_size, tokens):
    prior = None
    if salt is not None:
        prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode("utf-8")).digest()
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        for t in tokens[start:start + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.digest()
        out.append(prior[:8].hex())
    return out


if __name__ == "__main__":
    rows = [json.dumps(dict(case, hashes=page_hashes(**case)), ensure_ascii=False) for case in CASES]
    print("[\n" + ",\n".join(rows) + "\n]")
