"""The engine thread owns torch's threads (`runtime.cores`): after the reservation the main
thread runs torch on one thread, the wall-clock driver's engine thread on the reserved count,
and a helper thread started with `single_threaded` on one; the GIL switch interval is short.
In a fresh process: the reservation changes process-wide torch state."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_engine_thread_takes_the_reserved_threads_and_the_rest_run_on_one():
    script = textwrap.dedent("""
        import asyncio, json, sys
        from concurrent.futures import ThreadPoolExecutor
        import torch
        from metronome.engine.engine import EngineConfig
        from metronome.runtime import cores
        from metronome.runtime.ports import Listeners
        from metronome.runtime.wall import WallDriver

        torch.set_num_threads(2)
        assert cores.reserved_engine_threads() is None
        reserved = cores.reserve_for_engine_thread()
        again = cores.reserve_for_engine_thread(7)  # the first reservation stands

        class Engine:  # the driver only asks it for work on its thread here
            has_work = False
            config = EngineConfig()
            def step(self):
                raise AssertionError("no work was submitted")

        async def main():
            driver = WallDriver(Engine(), Listeners.of())
            seen = asyncio.get_running_loop().create_future()
            loop = asyncio.get_running_loop()
            driver.call_on_engine(lambda: loop.call_soon_threadsafe(
                seen.set_result, torch.get_num_threads()))
            engine_threads = await asyncio.wait_for(seen, 10)
            driver.close()
            return engine_threads

        engine_threads = asyncio.run(main())
        with ThreadPoolExecutor(1, initializer=cores.single_threaded) as pool:
            helper = pool.submit(torch.get_num_threads).result()
        print(json.dumps({"reserved": reserved, "again": again, "main": torch.get_num_threads(),
                          "engine": engine_threads, "helper": helper,
                          "switch_s": sys.getswitchinterval()}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip().splitlines()[-1]
    import json

    got = json.loads(out)
    # and the loop's Python lets the engine thread back in after each op within 0.5 ms
    assert got == {"reserved": 2, "again": 2, "main": 1, "engine": 2, "helper": 1,
                   "switch_s": 0.0005}


def test_the_gil_switch_alone_leaves_torchs_threads():
    """What `--engine vllm` gets (vLLM binds its own threads): the switch interval only."""
    import textwrap

    script = textwrap.dedent("""
        import sys, torch
        from metronome.runtime import cores
        torch.set_num_threads(2)
        cores.shorten_gil_switch()
        print(torch.get_num_threads(), cores.reserved_engine_threads(), sys.getswitchinterval())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["2", "None", "0.0005"]


def test_a_reservation_below_one_thread_is_refused():
    import pytest

    from metronome.runtime.cores import reserve_for_engine_thread

    with pytest.raises(ValueError, match="threads must be >= 1"):
        reserve_for_engine_thread(0)
