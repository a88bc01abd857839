"""benchmarks/host_time.py's charging of sampled stacks (the GPU measurement itself runs on the GPU only)."""
import threading
import time

from benchmarks import host_time


def test_a_sample_is_charged_to_the_innermost_project_frame_with_its_leaf_kind():
    stack = ["triton/runtime/jit.py(700): run", "kernels/fused_norm/triton.py(307): forward",
             "hf_hybrid/layers/norm.py(24): forward", "torch/nn/modules/module.py(1): _call_impl"]
    assert host_time.charge(stack) == ("kernels/fused_norm/triton.py(307): forward", "triton launch")
    assert host_time.charge(["torch/functional.py(3): einsum", "hf_hybrid/layers/mlp.py(27): forward"]) == (
        "hf_hybrid/layers/mlp.py(27): forward", "torch python")
    assert host_time.charge(["somewhere.py(1): f"]) == ("somewhere.py(1): f", "own python or op")
    assert host_time.charge([]) == ("(no frame)", "native")


def _spinner(path: str):
    """A function whose frames carry ``path`` as their file, spinning until its event is set."""
    namespace = {}
    exec(compile("def spin(stop):\n    while not stop.is_set():\n        pass\n", path, "exec"), namespace)
    return namespace["spin"]


def test_one_charge_per_tick_skips_idle_and_foreign_threads():
    """Of the threads other than the sampler's: one blocked in threading (idle) and one spinning
    outside the step's code (a compile worker's timer) are not charged; the one running the
    project's code is."""
    stop = threading.Event()
    threads = [threading.Thread(target=fn, args=(stop,), daemon=True)
               for fn in (lambda stop: stop.wait(), _spinner("/x/site-packages/torch/_inductor/timer.py"),
                          _spinner("/x/hf_hybrid/layers/spin.py"))]
    for thread in threads:
        thread.start()
    time.sleep(0.05)  # (releases the GIL: the spinners enter their loops)
    try:
        charges = {host_time.StackSampler._one_charge(me=threading.get_ident()) for _ in range(20)}
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert {(owner.split("(")[0], kind) for owner, kind in charges} == {("hf_hybrid/layers/spin.py", "own python or op")}, charges


def test_launch_cost_counts_the_outermost_of_nested_timed_calls():
    """benchmarks/launch_cost.py: a cached launch that falls back to Triton's run is one launch."""
    from benchmarks.launch_cost import LaunchTimes, timed_methods

    class Jit:
        def run(self):
            return "ran"

    class Cached:
        def __init__(self):
            self.jit = Jit()

        def launch(self):
            return self.jit.run()  # the fallback path

    cached = Cached()
    with timed_methods(LaunchTimes(), [(Jit, "run", lambda o: "k"), (Cached, "launch", lambda o: "k")]) as times:
        assert cached.launch() == "ran" and Jit().run() == "ran"
    assert times.calls == {"k": 2} and times.seconds["k"] > 0
    assert Jit.run.__name__ == "run" and Cached.launch.__name__ == "launch"  # restored
