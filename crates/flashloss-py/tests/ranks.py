"""Runs a worker script as WORLD processes of one Gloo group (rank and a file store on its
command line: ``worker WORLD RANK STORE``) and returns each rank's last stdout line, parsed
as JSON, in rank order; a rank that fails fails the test with its stderr."""

import json
import os
import subprocess
import sys


def run_ranks(worker, world, tmp_path, timeout=300):
    store = tmp_path / f"store-{world}"
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(world), str(rank), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank exited with {p.returncode}:\n{err[-4000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs
