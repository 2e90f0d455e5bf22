#!/usr/bin/python3
"""An independent subscriber of kvrelay's vLLM-format KV events (Debian's python3-zmq and
python3-msgpack; none of kvrelay's code). It rebuilds the per-node block index from the stream
and writes it, after every change, to --state as JSON:
  {"nodes": {node: [hash, ...]}, "tokens": {node: {hash: [token id, ...]}},
   "stored": [[node, hash, parent or null, [token id, ...], block_size], ...],
   "batches": n, "replays": n, "errors": [...]}
with hashes as decimal strings; "tokens" holds the token_ids of the blocks each node holds now,
"stored" every BlockStored received (one entry per block hash, the first 20000). Any deviation
from vLLM's KVEventBatch schema is recorded in "errors" (the test requires none).

The schema is a strict mirror of vLLM's msgspec types (vllm/distributed/kv_events.py; msgspec
itself is not in Debian 12): maps (not array_like), the tag "type" first, then the fields in
declaration order, fields equal to their default omitted (omit_defaults):
  EventBatch:       ts: float, events: list, data_parallel_rank: int | None = None
  BlockStored:      block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                    block_size: int, lora_id: int | None, medium: str | None,
                    lora_name: str | None, extra_keys: list | None = None,
                    group_idx: int | None = None, kv_cache_spec_kind: str | None = None,
                    kv_cache_spec_sliding_window: int | None = None
  BlockRemoved:     block_hashes: list[int], medium: str | None, group_idx: int | None = None
  AllBlocksCleared: (no field)
A BlockStored whose token_ids are not empty must hold len(block_hashes) * block_size of them.

Client algorithm (what a router does with vLLM's publisher):
  topic kv@<node>@<model>, one sequence per topic;
  a topic first seen at sequence > 0, or a gap, is filled from the replay socket
  ([b"", start, topic] -> [b"", seq, payload]... [b"", -1, b""]);
  after every (re)connection (socket monitor), every known topic is replayed from 0, which
  also covers a publisher restart (sequences start again at 0 with each node's full state).
With --curve-server-key (the publisher's Z85 public key) and --curve-client-key-file (this
subscriber's Z85 public key, then its secret key, one per line) both sockets are ZeroMQ CURVE
clients; handshakes the publisher refuses are counted in "handshake_failures".
"""
import argparse
import json
import os
import signal
import sys

import msgpack
import zmq
import zmq.utils.monitor



def is_u64(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 64


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def optional(check):
    return lambda v: v is None or check(v)


def list_of(check):
    return lambda v: isinstance(v, list) and all(map(check, v))


def is_str(v):
    return isinstance(v, str)


# (field, type check, required) in vLLM's declaration order; optional fields default to None.
SCHEMAS = {
    "BlockStored": [
        ("block_hashes", list_of(is_u64), True),
        ("parent_block_hash", optional(is_u64), True),
        ("token_ids", list_of(lambda t: is_int(t) and -2 ** 31 <= t < 2 ** 31), True),
        ("block_size", lambda v: is_int(v) and v > 0, True),
        ("lora_id", optional(is_int), True),
        ("medium", optional(is_str), True),
        ("lora_name", optional(is_str), True),
        ("extra_keys", optional(lambda v: isinstance(v, list)), False),
        ("group_idx", optional(is_int), False),
        ("kv_cache_spec_kind", optional(is_str), False),
        ("kv_cache_spec_sliding_window", optional(is_int), False),
    ],
    "BlockRemoved": [
        ("block_hashes", list_of(is_u64), True),
        ("medium", optional(is_str), True),
        ("group_idx", optional(is_int), False),
    ],
    "AllBlocksCleared": [],
}
BATCH_SCHEMA = [("ts", lambda v: isinstance(v, float), True),
                ("events", lambda v: isinstance(v, list), True),
                ("data_parallel_rank", optional(is_int), False)]
MAX_STORED_LOG = 20000


def is_map(v):
    """A msgpack map as decoded with object_pairs_hook=list (arrays stay lists of values)."""
    return isinstance(v, list) and all(isinstance(p, tuple) and len(p) == 2 for p in v)


def check_fields(pairs, schema):
    """None when `pairs` (a map's (key, value) pairs in wire order) is exactly `schema` in
    order, optional fields possibly left out; otherwise what is wrong."""
    if not is_map(pairs):
        return f"not a map: {pairs!r}"[:300]
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        return f"duplicate keys {keys}"
    position = 0
    for key, value in pairs:
        while position < len(schema) and schema[position][0] != key:
            if schema[position][2]:
                return f"required field {schema[position][0]!r} missing or out of order in {keys}"
            position += 1
        if position == len(schema):
            return f"unknown or out-of-order field {key!r} in {keys}"
        if not schema[position][1](value):
            return f"field {key!r} has a wrong type: {value!r}"[:300]
        position += 1
    for name, _, required in schema[position:]:
        if required:
            return f"required field {name!r} missing in {keys}"
    return None


class Subscriber:
    def __init__(self, args):
        self.args = args
        self.ctx = zmq.Context()
        self.curve = None
        if args.curve_server_key:
            with open(args.curve_client_key_file) as f:
                public, secret = f.read().split()[:2]
            self.curve = (args.curve_server_key.encode(), public.encode(), secret.encode())
        self.sub = self.ctx.socket(zmq.SUB)
        self.secure(self.sub)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.monitor = self.sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.sub.connect(args.endpoint)
        self.handshake_failures = 0
        self.nodes = {}   # node -> {hash: token_ids}
        self.stored = []  # every BlockStored block: [node, hash, parent, token_ids, block_size]
        self.last = {}    # topic -> last applied sequence
        self.batches = 0
        self.replays = 0
        self.errors = []

    def secure(self, socket):
        if self.curve:
            server, public, secret = self.curve
            socket.curve_serverkey = server
            socket.curve_publickey = public
            socket.curve_secretkey = secret

    def error(self, message):
        if len(self.errors) < 50:
            self.errors.append(message)

    def check_event(self, pairs):
        """The event as a dict when it matches vLLM's tagged types exactly, else None."""
        if (not is_map(pairs) or not pairs or pairs[0][0] != "type"
                or pairs[0][1] not in SCHEMAS):
            self.error(f"event is not a map tagged first with a known type: {pairs!r}"[:300])
            return None
        kind = pairs[0][1]
        wrong = check_fields(pairs[1:], SCHEMAS[kind])
        if wrong:
            self.error(f"{kind}: {wrong}")
            return None
        e = dict(pairs)
        # kvrelay sets neither LoRA field.
        if kind == "BlockStored" and (e["lora_id"] is not None or e["lora_name"] is not None):
            self.error(f"BlockStored with a LoRA: {e!r}"[:300])
            return None
        if kind == "BlockStored" and e["token_ids"] and (
                len(e["token_ids"]) != len(e["block_hashes"]) * e["block_size"]):
            self.error(f"BlockStored: {len(e['token_ids'])} token_ids for "
                       f"{len(e['block_hashes'])} blocks of {e['block_size']}")
            return None
        return e

    def apply(self, topic, seq, payload):
        parts = topic.split("@")
        if len(parts) != 3 or parts[0] != "kv" or parts[2] != self.args.model:
            self.error(f"topic {topic!r}")
            return
        node = parts[1]
        try:
            # Maps as (key, value) lists in wire order, so the field order can be checked.
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=True,
                                    object_pairs_hook=list)
        except Exception as ex:  # any decoding failure is a format error
            self.error(f"msgpack: {ex}")
            return
        wrong = check_fields(batch, BATCH_SCHEMA)
        if wrong:
            self.error(f"batch: {wrong}"[:300])
            return
        batch = dict(batch)
        blocks = self.nodes.setdefault(node, {})
        for pairs in batch["events"]:
            e = self.check_event(pairs)
            if e is None:
                continue
            if e["type"] == "BlockStored":
                size = e["block_size"]
                tokens = e["token_ids"]
                parent = e["parent_block_hash"]
                for i, h in enumerate(e["block_hashes"]):
                    mine = tokens[i * size:(i + 1) * size]
                    blocks[h] = mine
                    if len(self.stored) < MAX_STORED_LOG:
                        self.stored.append([node, str(h), None if parent is None else str(parent),
                                            mine, size])
                    parent = h
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    blocks.pop(h, None)
            else:
                blocks.clear()
        self.last[topic] = seq
        self.batches += 1

    def replay(self, topic, start):
        """Fills `topic` from `start` through the replay socket, in order."""
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        self.secure(dealer)
        dealer.connect(self.args.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big"), topic.encode()])
        while True:
            if not dealer.poll(5000):
                self.error(f"replay of {topic} from {start} timed out")
                break
            frames = dealer.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                self.error(f"replay frames {len(frames)}")
                break
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == -1:
                break
            if seq > self.last.get(topic, -1):
                self.apply(topic, seq, frames[2])
        dealer.close()

    def on_live(self, frames):
        if len(frames) != 3 or len(frames[1]) != 8:
            self.error(f"live message of {len(frames)} frames")
            return
        topic = frames[0].decode()
        seq = int.from_bytes(frames[1], "big")
        last = self.last.get(topic)
        if last is not None and seq <= last:
            return  # already applied through a replay
        expected = 0 if last is None else last + 1
        if seq != expected:
            self.replay(topic, expected)  # fills the gap, and usually this message too
            if seq <= self.last.get(topic, -1):
                return
        self.apply(topic, seq, frames[2])

    def on_connected(self):
        # A reconnection may be to a restarted publisher: rebuild every known topic from 0.
        for topic in list(self.last):
            node = topic.split("@")[1]
            self.last[topic] = -1
            self.nodes[node] = {}
            self.replay(topic, 0)

    def dump(self):
        state = {"nodes": {n: sorted(str(h) for h in b) for n, b in self.nodes.items()},
                 "tokens": {n: {str(h): t for h, t in b.items()} for n, b in self.nodes.items()},
                 "stored": self.stored,
                 "batches": self.batches, "replays": self.replays, "errors": self.errors,
                 "handshake_failures": self.handshake_failures}
        tmp = self.args.state + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, sort_keys=True)
        os.replace(tmp, self.args.state)

    def run(self):
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self.dump()
        print("subscriber ready", flush=True)
        while True:
            ready = dict(poller.poll(200))
            changed = False
            while self.monitor.poll(0):
                event = zmq.utils.monitor.recv_monitor_message(self.monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.on_connected()
                    changed = True
                elif event["event"] != zmq.EVENT_DISCONNECTED:
                    self.handshake_failures += 1
                    changed = True
            if self.sub in ready:
                while self.sub.poll(0):
                    self.on_live(self.sub.recv_multipart())
                    changed = True
            if changed:
                self.dump()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--model", default="kvrelay")
    parser.add_argument("--state", required=True)
    parser.add_argument("--curve-server-key", default="")
    parser.add_argument("--curve-client-key-file", default="")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Subscriber(args).run()


if __name__ == "__main__":
    main()
