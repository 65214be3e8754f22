"""A userspace link: carries Ethernet frames between two interfaces, each one delayed and a
fraction dropped (what `tc netem` does, for kernels built without it). Test use only.

    python -m meshd.testing.shaper IF_A IF_B DELAY_MS LOSS [SEED]

Frames arriving on IF_A leave on IF_B `DELAY_MS` later and the other way round, each dropped
with probability LOSS, in order per direction. Runs until SIGTERM; prints "forwarding" once
both sockets are bound, and counts on exit.
"""

from __future__ import annotations

import heapq
import random
import selectors
import signal
import socket
import struct
import sys
import time
from array import array

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # what we (or the kernel) sent on the interface: not ours to carry
MAX_FRAME = 65536


def tcp_checksummed(frame: bytes) -> bytes:
    """The frame with its TCP checksum computed. A veth leaves it to "hardware" (checksum
    offload), and a frame read from a packet socket and sent again would arrive with it
    unfilled and be dropped."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return frame
    ihl = (frame[14] & 0x0F) * 4
    start, end = 14 + ihl, 14 + int.from_bytes(frame[16:18], "big")
    if end > len(frame) or end - start < 20:
        return frame
    segment = bytearray(frame[start:end])
    segment[16:18] = b"\0\0"
    data = frame[26:34] + bytes((0, 6)) + (end - start).to_bytes(2, "big") + segment
    if len(data) % 2:
        data += b"\0"
    total = sum(array("H", data))  # native-order words: the one's-complement sum is order-free
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    segment[16:18] = struct.pack("=H", ~total & 0xFFFF)
    return frame[:start] + bytes(segment) + frame[end:]


def _open(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def main(argv: list[str]) -> int:
    if_a, if_b, delay_ms, loss = argv[0], argv[1], int(argv[2]), float(argv[3])
    rng = random.Random(int(argv[4]) if len(argv) > 4 else 1)
    delay_s = delay_ms / 1000
    a, b = _open(if_a), _open(if_b)
    other = {a: b, b: a}
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ)
    sel.register(b, selectors.EVENT_READ)
    queue: list[tuple[float, int, socket.socket, bytes]] = []
    seq = carried = dropped = failed = 0
    running = True

    def stop(*_: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    print("forwarding", if_a, "<->", if_b, f"delay {delay_ms} ms, loss {loss}", flush=True)
    while running:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                out.send(frame)
                carried += 1
            except OSError:
                failed += 1
        timeout = max(0.0, queue[0][0] - now) if queue else 0.5
        for key, _ in sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            while True:
                try:
                    frame, addr = sock.recvfrom(MAX_FRAME)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue
                if rng.random() < loss:
                    dropped += 1
                    continue
                seq += 1
                heapq.heappush(queue, (time.monotonic() + delay_s, seq, other[sock], tcp_checksummed(frame)))
    print(f"carried {carried}, dropped {dropped}, send errors {failed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
