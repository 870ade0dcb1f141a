"""What a run shows while it runs (jaxdp.run.progress): images/s without the compile, plain
progress lines when the output is a file."""

import io

from jaxdp.run import progress
from jaxdp.run.progress import PlainProgress, Throughput


def test_throughput_leaves_out_the_compile_and_is_a_moving_median(monkeypatch):
    # Steps finish at these times: the first after a 30 s compile, one after a 50 s hiccup.
    clock = iter([30.0, 31.0, 32.0, 82.0, 83.0, 84.0, 100.0, 100.5])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    t = Throughput(images_per_step=32, window=4)
    assert t.tick() is None  # the compile's step: no step time known yet
    assert [t.tick() for _ in range(5)] == [32.0, 32.0, 32.0, 32.0, 32.0]  # median of 1, 1, 50, 1, 1 s
    t.restart()  # an evaluation ran in between: that gap is not a step
    assert t.tick() == 32.0  # the 16 s gap left out
    assert t.tick() == 32.0  # the window now holds 50, 1, 1, 0.5 s: median 1 s


def test_plain_progress_prints_lines_not_carriage_returns():
    out = io.StringIO()
    bar = PlainProgress(total=25, initial=0, desc="epoch 1/2", every=10, file=out)
    for i in range(25):
        bar.set_postfix(loss=f"{2.0 - i / 100:.2f}")
        bar.update()
    bar.close()
    assert out.getvalue() == ("epoch 1/2: step 10/25 (loss 1.91)\n"
                              "epoch 1/2: step 20/25 (loss 1.81)\n"
                              "epoch 1/2: step 25/25 (loss 1.76)\n")
