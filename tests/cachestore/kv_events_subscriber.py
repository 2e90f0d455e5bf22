#!/usr/bin/python3
"""An independent subscriber of kvrelay's vLLM-format KV events (Debian's python3-zmq and
python3-msgpack; none of kvrelay's code). It rebuilds the per-node block index from the stream
and writes it, after every change, to --state as JSON:
  {"nodes": {node: [hash, ...]}, "batches": n, "replays": n, "errors": [...]}
with hashes as decimal strings. Any deviation from vLLM's KVEventBatch schema is recorded in
"errors" (the test requires none).

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

BLOCK_STORED_REQUIRED = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "lora_id", "medium", "lora_name"}
BLOCK_STORED_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind",
                         "kv_cache_spec_sliding_window"}
BLOCK_REMOVED_REQUIRED = {"type", "block_hashes", "medium"}
BLOCK_REMOVED_OPTIONAL = {"group_idx"}


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
        self.nodes = {}   # node -> set of hashes
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

    def is_u64(self, v):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 64

    def check_event(self, e):
        if not isinstance(e, dict) or not isinstance(e.get("type"), str):
            self.error(f"event is not a tagged map: {e!r}")
            return False
        keys = set(e)
        if e["type"] == "BlockStored":
            if not BLOCK_STORED_REQUIRED <= keys or not keys <= BLOCK_STORED_REQUIRED | BLOCK_STORED_OPTIONAL:
                self.error(f"BlockStored fields {sorted(keys)}")
                return False
            ok = (isinstance(e["block_hashes"], list) and all(map(self.is_u64, e["block_hashes"]))
                  and (e["parent_block_hash"] is None or self.is_u64(e["parent_block_hash"]))
                  and isinstance(e["token_ids"], list) and isinstance(e["block_size"], int)
                  and e["block_size"] > 0 and e["lora_id"] is None and e["lora_name"] is None
                  and (e["medium"] is None or isinstance(e["medium"], str))
                  and isinstance(e.get("group_idx", 0), int))
        elif e["type"] == "BlockRemoved":
            if not BLOCK_REMOVED_REQUIRED <= keys or not keys <= BLOCK_REMOVED_REQUIRED | BLOCK_REMOVED_OPTIONAL:
                self.error(f"BlockRemoved fields {sorted(keys)}")
                return False
            ok = (isinstance(e["block_hashes"], list) and all(map(self.is_u64, e["block_hashes"]))
                  and (e["medium"] is None or isinstance(e["medium"], str)))
        elif e["type"] == "AllBlocksCleared":
            ok = keys == {"type"}
        else:
            ok = False
        if not ok:
            self.error(f"bad {e['type']}: {e!r}")
        return ok

    def apply(self, topic, seq, payload):
        parts = topic.split("@")
        if len(parts) != 3 or parts[0] != "kv" or parts[2] != self.args.model:
            self.error(f"topic {topic!r}")
            return
        node = parts[1]
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as ex:  # any decoding failure is a format error
            self.error(f"msgpack: {ex}")
            return
        if (not isinstance(batch, dict) or set(batch) != {"ts", "events", "data_parallel_rank"}
                or not isinstance(batch["ts"], float) or not isinstance(batch["events"], list)
                or not isinstance(batch["data_parallel_rank"], int)):
            self.error(f"batch shape: {batch!r}"[:300])
            return
        blocks = self.nodes.setdefault(node, set())
        for e in batch["events"]:
            if not self.check_event(e):
                continue
            if e["type"] == "BlockStored":
                blocks.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                blocks.difference_update(e["block_hashes"])
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
            self.nodes[node] = set()
            self.replay(topic, 0)

    def dump(self):
        state = {"nodes": {n: sorted(str(h) for h in b) for n, b in self.nodes.items()},
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
