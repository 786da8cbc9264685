#!/usr/bin/env python3
"""Block hashes as vLLM's prefix cache computes them, for kvrouter's golden
test (extrakeys_golden_test.go). Writes vllm_block_hashes.json.

Follows vLLM's vllm/v1/core/kv_cache_utils.py of the 0.19 series
(generate_block_hash_extra_keys: LoRA name, multimodal items as
(identifier, offset of the item relative to the block start), cache_salt on
the block starting at token 0, prompt-embeds digests; hash_block_tokens:
hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))) and
vllm/utils/hashing.py at commit ac621345a4eb18058bb24b242b457f634d476b40
(sha256_cbor: SHA-256 of cbor2.dumps(obj, canonical=True)). NONE_HASH is
hash_fn(PYTHONHASHSEED), or hash_fn("vllm-none-hash") for a cryptographic
hash_fn when PYTHONHASHSEED is unset; the vectors use the latter.

Needs only cbor2 (Debian: python3-cbor2). Run: python3 vllm_block_hashes.py
"""

import hashlib
import json
import os

import cbor2

BLOCK_SIZE = 16


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


NONE_HASH = sha256_cbor(os.getenv("PYTHONHASHSEED", "vllm-none-hash"))


def extra_keys(req, start, end):
    """The extra keys of the block [start, end), in vLLM's order."""
    keys = []
    if req.get("lora"):
        keys.append(req["lora"])
    for item in req.get("mm", []):
        off, length = item["offset"], item["length"]
        if end > off and start < off + length:
            keys.append((item["identifier"], off - start))
    if start == 0 and req.get("salt"):
        keys.append(req["salt"])
    return tuple(keys) if keys else None


def block_hashes(req):
    parent, out, published = None, [], []
    tokens = req["tokens"]
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        end = start + BLOCK_SIZE
        keys = extra_keys(req, start, end)
        h = sha256_cbor((parent or NONE_HASH, tuple(tokens[start:end]), keys))
        out.append(h.hex())
        published.append(None if keys is None else [list(k) if isinstance(k, tuple) else k for k in keys])
        parent = h
    return out, published


def tokens(n, seed):
    return [1000 + (i * 37 + seed * 7919) % 30000 for i in range(n)]


IMAGE = hashlib.sha256(b"an image").hexdigest()
PROMPT = tokens(48, 1)
LONGER = PROMPT + tokens(16, 2)

REQUESTS = [
    {"name": "plain", "tokens": PROMPT},
    {"name": "salt a", "tokens": PROMPT, "salt": "tenant-a"},
    {"name": "salt b", "tokens": PROMPT, "salt": "tenant-b"},
    {"name": "salt a, longer", "tokens": LONGER, "salt": "tenant-a"},
    {"name": "plain, longer", "tokens": LONGER},
    {"name": "adapter", "tokens": PROMPT, "lora": "sql"},
    {"name": "adapter, salt a", "tokens": PROMPT, "lora": "sql", "salt": "tenant-a"},
    {"name": "adapter, salt equal to its name", "tokens": PROMPT, "lora": "sql", "salt": "sql"},
    {"name": "salt of 64 hex digits", "tokens": PROMPT, "salt": "ab" * 32},
    {"name": "image", "tokens": PROMPT, "mm": [{"identifier": IMAGE, "offset": 4, "length": 8}]},
    {"name": "image, salt a", "tokens": PROMPT, "salt": "tenant-a",
     "mm": [{"identifier": IMAGE, "offset": 4, "length": 8}]},
]


def main():
    out = []
    for req in REQUESTS:
        hashes, published = block_hashes(req)
        out.append({
            "name": req["name"], "tokens": req["tokens"], "lora": req.get("lora", ""),
            "salt": req.get("salt", ""), "mm": req.get("mm", []),
            "engine_hashes": hashes, "extra_keys": published,
        })
    doc = {"block_size": BLOCK_SIZE, "none_hash": NONE_HASH.hex(), "requests": out}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_block_hashes.json")
    with open(path, "w") as f:
        # One request a line: the vectors diff line by line.
        head = json.dumps({k: v for k, v in doc.items() if k != "requests"})[:-1]
        f.write(head + ', "requests": [\n')
        f.write(",\n".join(json.dumps(r) for r in doc["requests"]))
        f.write("\n]}\n")


if __name__ == "__main__":
    main()
