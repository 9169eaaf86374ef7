"""shared.heap: a service's start-up heap collected once, then frozen (in a child process: freezing
the test process's heap would keep its garbage for the rest of the session)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.epdup import REPO

CHILD = """
import gc, json, weakref
from shared.heap import freeze_startup_heap

gc.disable()  # only the collection freeze_startup_heap makes: none by allocation counts

class Node:
    pass

garbage = Node(); garbage.me = garbage  # a reference cycle only a collection frees
dead = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(1000)]
frozen = freeze_startup_heap()
after = Node()
print(json.dumps({
    "returned": frozen,
    "frozen": gc.get_freeze_count(),
    "garbage_collected": dead() is None,
    "kept_frozen": not any(o is kept[0] for o in gc.get_objects()),
    "later_tracked": any(o is after for o in gc.get_objects()),
}))
"""


def test_the_start_up_heap_is_collected_then_frozen_and_later_objects_are_not():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["returned"] == got["frozen"] > 1000, got
    # the cycle that was garbage at start-up was collected, not frozen for the process's life
    assert got["garbage_collected"], got
    # what was alive is out of the collector's generations; what came after is in them
    assert got["kept_frozen"] and got["later_tracked"], got
