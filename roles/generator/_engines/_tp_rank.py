"""A tensor-parallel generator's rank ``1 ..`` process (:class:`~._tp.TPRanks` starts it):
its orders as JSON on stdin; it loads its share of the model, says it is ready, joins the
group and runs the leader's steps until told to stop. It leaves when its parent (the
leader) is gone."""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def main() -> int:
    order = json.loads(sys.stdin.read())
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    import torch

    from orchestr.roles._common._alloc import keep_freed_memory
    from orchestr.roles._common._hf._tp import load_shard

    from .._runner._cache import KVCache
    from .._runner._paged import PagedRunner
    from .._runner._tp import TPGroup
    from ._tp import give_weights, take_weights

    torch.set_num_threads(int(order["threads"]))
    device = torch.device(order["device"])
    dtype = getattr(torch, order["dtype"])
    model = load_shard(order["checkpoint"], order["tp"], order["rank"], dtype=dtype, device=device)
    kv = KVCache(model, order["num_blocks"], order["block_size"])
    if device.type == "cpu":
        keep_freed_memory()
    with open(order["ready"], "w"):
        pass
    group = TPGroup(order["store"], order["rank"], order["tp"], device)
    runner = PagedRunner(
        model, kv, packed=order["packed"], attention=order["attention"], group=group
    )
    while True:
        message = group.receive()
        op = message["op"]
        if op == "work":
            runner.run_work(group.work_of(message))
        elif op == "weights":
            take_weights(group, model, message["names"])
            runner.weights_changed()
        elif op == "gather":
            give_weights(group, model)
        elif op == "kv_export":
            group.send_tensor(kv.rows(message["blocks"]), 0)
        elif op == "kv_write":
            first = kv.keys[0]
            planes = first.new_empty((2 * len(kv.keys), len(message["blocks"]), *first.shape[1:]))
            kv.write(message["blocks"], group.receive_tensor(planes))
        elif op == "stop":
            break
        else:
            raise ValueError(f"a tensor-parallel rank got an unknown order {op!r}")
    group.close()
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no module teardown: torch's groups may hold threads
