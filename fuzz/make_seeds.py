"""Seeds for the WAL, data-plane frame, safetensors and HF-config fuzzers (fuzz/make_seeds.sh).

Writes little-endian encodings by hand, mirroring cachestore/wal.cc and transfer/ucx/wire.h,
so the seeds need no build. XXH32 (the WAL's record checksum) is written out below.
"""
import json
import os
import struct
import sys

CORPUS = sys.argv[1]


def write(target, name, data):
    with open(os.path.join(CORPUS, target, name), "wb") as f:
        f.write(data)


# --- XXH32 (github.com/Cyan4973/xxHash, spec in doc/xxhash_spec.md) -------------------------
P1, P2, P3, P4, P5 = 2654435761, 2246822519, 3266489917, 668265263, 374761393
M = 0xFFFFFFFF


def rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & M


def xxh32(data, seed):
    n = len(data)
    i = 0
    if n >= 16:
        v = [(seed + P1 + P2) & M, (seed + P2) & M, seed & M, (seed - P1) & M]
        while i + 16 <= n:
            for k in range(4):
                lane = struct.unpack_from("<I", data, i + 4 * k)[0]
                v[k] = (rotl((v[k] + lane * P2) & M, 13) * P1) & M
            i += 16
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M
    else:
        h = (seed + P5) & M
    h = (h + n) & M
    while i + 4 <= n:
        h = (rotl((h + struct.unpack_from("<I", data, i)[0] * P3) & M, 17) * P4) & M
        i += 4
    while i < n:
        h = (rotl((h + data[i] * P5) & M, 11) * P1) & M
        i += 1
    h ^= h >> 15
    h = (h * P2) & M
    h ^= h >> 13
    h = (h * P3) & M
    h ^= h >> 16
    return h


def u8(v): return struct.pack("<B", v)
def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def i32(v): return struct.pack("<i", v)
def s(b): return u32(len(b)) + b
def h128(hi, lo): return u64(hi) + u64(lo)


# --- WAL ---------------------------------------------------------------------------------
def register(node, segments=1):
    out = u8(1) + s(node) + s(b"ucx") + s(b"127.0.0.1:7000") + u64(10000) + u32(segments)
    for k in range(segments):
        out += s(b"s%d" % k) + u8(2) + u64(64) + u64(4096) + s(b"key")
    return out + u64(7) + u8(1) + s(b"127.0.0.1:7001")


def commit(seq, hi, parent_hi, replicas=1):
    out = u8(3) + u64(seq) + h128(hi, 1) + h128(parent_hi, 1 if parent_hi else 0) + u32(4096)
    out += u32(replicas)
    for _ in range(replicas):
        out += s(b"prefill-0") + s(b"s0") + u32(seq)
    return out


ops = [register(b"prefill-0"), commit(1, 1, 0), commit(2, 2, 1), u8(4) + u64(3) + h128(2, 1),
       u8(5) + u64(100), u8(2) + s(b"prefill-0")]


def frame(payloads):
    return b"".join(u32(len(p)) + u32(xxh32(p, 0x6B76)) + p for p in payloads)


W = "wal_fuzzer"
write(W, "log", frame(ops))
write(W, "torn-tail", frame(ops)[:-5])
bad = bytearray(frame(ops))
bad[20] ^= 0xFF
write(W, "bad-checksum", bytes(bad))
for k, op in enumerate(ops):
    write(W, "op-%d" % k, op)
write(W, "op-register-many-segments", register(b"n", 3))
write(W, "op-unknown-type", u8(9) + u64(1))
write(W, "op-huge-count", u8(3) + u64(1) + h128(1, 1) + h128(0, 0) + u32(1) + u32(0xFFFFFFFF))
# A commit with its block's tokens (the replication stream's form), and one whose count lies.
write(W, "op-commit-tokens", commit(1, 1, 0) + u32(4) + u32(1) + u32(2) + u32(0xFFFFFFFE) + u32(7))
write(W, "op-tokens-count-lies", commit(1, 1, 0) + u32(0xFFFFFFFF) + u32(1))
write(W, "huge-length", u32(0x7FFFFFFF) + u32(0) + b"x")

# --- Data-plane control frames (transfer/ucx/wire.h, version 3) -------------------------
MAGIC, VERSION = 0x5852564B, 3


def wire(ftype, payload):
    return u32(len(payload) + 1) + u8(ftype) + payload


region = u64(77) + u64(0x7F0000000000) + u64(1 << 20) + s(b"packed-rkey")
hello = (u32(MAGIC) + u32(VERSION) + u64(42) + s(b"127.0.0.1:7000") + s(b"k" * 32) +
         s(b"ucx-worker-address") + u32(1) + region)
done = (u64(1) + u64(0xABCDEF) + i32(0) + i32(1) + u32(2) +
        u64(77) + u64(0) + u64(4096) + u8(1) + u64(0x1234) +
        u64(77) + u64(8192) + u64(4096) + u8(0) + u64(0) + s(b"t" * 32))
ack = u64(1) + u32(2) + u8(0) + u8(15) + s(b"receiver: checksum mismatch")
control = u64(0xABCDEF) + s(b"claim")
F = "control_frame_fuzzer"
write(F, "hello", wire(1, hello))
write(F, "session", wire(1, hello) + wire(2, region) + wire(3, u64(77)) + wire(4, done) +
      wire(5, ack) + wire(6, control) + wire(7, b"") + wire(8, b""))
write(F, "refuse", wire(9, s(b"wrong data-plane key")))
write(F, "done-truncated", wire(4, done[:-10]))
write(F, "done-block-count-lies", wire(4, u64(1) + u64(2) + i32(0) + i32(1) + u32(1 << 30)))
write(F, "hello-old-version", wire(1, u32(MAGIC) + u32(2) + u64(42) + s(b"a")))
write(F, "hello-region-count-lies", wire(1, hello[:-len(region) - 4] + u32(1 << 20)))
write(F, "bad-length", u32(0) + u8(1) + wire(7, b""))
write(F, "partial", wire(4, done)[:17])

# --- safetensors near-valid --------------------------------------------------------------
def safetensors(header, data=b""):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return u64(len(h)) + h + data


S = "safetensors_fuzzer"
write(S, "two-tensors", safetensors(
    {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
     "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]},
     "__metadata__": {"format": "pt"}}, bytes(range(24))))
write(S, "fp16-scalar", safetensors(
    {"x": {"dtype": "F16", "shape": [], "data_offsets": [0, 2]}}, b"\x00\x3c"))
write(S, "overlap", safetensors(
    {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)))
write(S, "past-end", safetensors(
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
write(S, "unknown-dtype", safetensors(
    {"a": {"dtype": "I4", "shape": [1], "data_offsets": [0, 1]}}, bytes(1)))
write(S, "header-length-huge", u64(1 << 62) + b"{}")
write(S, "not-json", u64(4) + b"{{{{")
# A shape whose element count wraps to 0 in 64 bits was accepted with 0 bytes (found while
# writing this fuzzer; model/safetensors.cc now checks before multiplying).
write(S, "regress-shape-overflow", safetensors(
    {"a": {"dtype": "F32", "shape": [1 << 40, 1 << 24], "data_offsets": [0, 0]}}))

# --- HF configs near-valid ---------------------------------------------------------------
base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
H = "hf_config_fuzzer"
variants = {
    "kv-heads-not-divisor": {"num_key_value_heads": 3},
    "zero-heads": {"num_attention_heads": 0},
    "negative-layers": {"num_hidden_layers": -1},
    "huge-hidden": {"hidden_size": 1 << 62},
    "float-layers": {"num_hidden_layers": 2.5},
    "unknown-type": {"model_type": "no-such-arch"},
    "sliding": {"model_type": "mistral", "sliding_window": 16},
    "mla": {"model_type": "deepseek_v3", "kv_lora_rank": 32, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16},
    "rope-scaling": {"rope_scaling": {"type": "llama3", "factor": 8.0}},
}
for name, change in variants.items():
    write(H, name + ".json", json.dumps(dict(base, **change)).encode())
write(H, "truncated.json", json.dumps(base).encode()[:-7])
write(H, "not-an-object.json", b"[1, 2, 3]")
