"""Diagnostic: the speech example's heavy encoder (8 s of audio, 64 layers of 4096) queued on
PyTorch's default stream, on a PyTorch stream and on an ExternalStream of a deviceop pool stream
(host time of the calls), then as the example's chunk op (synced, and awaited under uvloop)
beside the blocking PyTorch chunk. Medians of 25 after 5, each between two device syncs.

    python experiments/asr_encoder_cost.py     (from the repository root, on cuda)
"""

import statistics
import sys
import time

sys.path.insert(0, "examples/asr_stream")
import numpy as np
import run as asr
import torch

import deviceop as do

enc = asr.Encoder("cuda", 4096, 64)
x_np = (np.random.default_rng(0).standard_normal(8 * 16000) * 0.1).astype(np.float32)
frames = enc.frames(len(x_np))


def timed(fn, n=30):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return 1e3 * statistics.median(ts[5:])


xg = torch.from_numpy(x_np).cuda()
print("default stream enqueue", timed(lambda: enc(xg)))
s = torch.cuda.Stream()


def on_stream():
    with torch.cuda.stream(s):
        enc(xg)


print("torch.cuda.Stream", timed(on_stream))
ds = do.streams()[0]


def on_ext():
    with torch.cuda.stream(torch.cuda.ExternalStream(ds.handle_int)):
        enc(xg)


print("ExternalStream(deviceop pool stream)", timed(on_ext))
xd = do.from_numpy(x_np).sync()
out = do.empty((frames, len(asr.SYMBOLS)), do.float32).sync()


def enc_fn(stream, x, o):
    with torch.cuda.stream(torch.cuda.ExternalStream(stream.handle_int)):
        torch.from_dlpack(o).copy_(enc(torch.from_dlpack(x)))


def ext():
    do.external(enc_fn, xd, out, reads=(xd,), writes=(out,)).sync()


print("do.external sync (enqueue+run)", timed(ext))


def ext_full():
    op = do.zip(do.from_numpy(x_np), do.empty((frames, len(asr.SYMBOLS)), do.float32)).then(
        lambda xo: do.external(enc_fn, xo[0], xo[1], reads=(xo[0],), writes=(xo[1],)).then(lambda _: do.to_numpy(xo[1]))
    )
    op.sync()


print("example chunk op sync", timed(ext_full))


def blocking():
    enc(torch.from_numpy(x_np).to("cuda")).cpu()


print("blocking torch chunk", timed(blocking))


async def aw():
    op = do.zip(do.from_numpy(x_np), do.empty((frames, len(asr.SYMBOLS)), do.float32)).then(
        lambda xo: do.external(enc_fn, xo[0], xo[1], reads=(xo[0],), writes=(xo[1],)).then(lambda _: do.to_numpy(xo[1]))
    )
    await op


import uvloop

print("example chunk op awaited (uvloop)", timed(lambda: uvloop.run(aw())))
