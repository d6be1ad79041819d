"""The peer watch (jaxllm/runtime/peer_watch.py): a survivor names the process whose link closed without a "bye" and
exits 1; a clean exit is not taken for a death; process 0 tells the others whom it lost. In-process, on socket
pairs and on the real start-up rendezvous (the multi-process drill of tests/test_multiprocess.py kills a real
process)."""

import socket
import threading
import time

from jaxllm.runtime.distributed import ProcessLayout, free_port_pair, rendezvous
from jaxllm.runtime.peer_watch import PeerWatch


class Verdicts:
    """What a watch reported and the exit code it asked for, instead of printing and exiting this process."""

    def __init__(self):
        self.lines, self.codes = [], []

    def watch(self, process_id, num_processes, links):
        return PeerWatch(process_id, num_processes, links, report=self.lines.append, exit=self.codes.append).start()

    def wait(self, timeout=5.0):
        deadline = time.monotonic() + timeout
        while not self.codes and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.lines


def recv_all(sock, timeout=5.0) -> str:
    sock.settimeout(timeout)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data.decode()
        data += chunk


def test_process_0_names_the_dead_process_and_tells_the_others():
    verdicts = Verdicts()
    (ours_1, theirs_1), (ours_2, theirs_2) = socket.socketpair(), socket.socketpair()
    watch = verdicts.watch(0, 3, {1: ours_1, 2: ours_2})
    theirs_2.close()  # process 2 is killed: its kernel closes its end
    assert verdicts.wait() == ["jaxllm: process 2 of 3 stopped responding (link to process 0 closed); exiting so "
                               "the job can be requeued"]
    assert verdicts.codes == [1] and watch.verdict.is_set()
    ours_1.close()  # process 0 exits: process 1 reads whom it lost before the link closes
    assert recv_all(theirs_1) == "gone 2\n"


def test_process_k_names_the_coordinator_or_the_process_it_was_told_of():
    verdicts = Verdicts()
    ours, theirs = socket.socketpair()
    verdicts.watch(1, 2, {0: ours})
    theirs.close()
    assert verdicts.wait() == ["jaxllm: process 0 (the coordinator) is unreachable: its link to process 1 of 2 "
                               "closed; exiting so the job can be requeued"]

    told = Verdicts()
    ours, theirs = socket.socketpair()
    told.watch(2, 4, {0: ours})
    theirs.sendall(b"gone 1\ngone 3\n")
    theirs.close()
    assert told.wait() == ["jaxllm: processes 1, 3 of 4 stopped responding (link to process 2 closed); exiting so "
                           "the job can be requeued"]


def test_a_clean_exit_is_not_a_death():
    verdicts = Verdicts()
    ours, theirs = socket.socketpair()
    verdicts.watch(0, 2, {1: ours})
    theirs.sendall(b"bye\n")  # process 1 finished (its atexit), then exits
    theirs.close()
    leaving = Verdicts()
    ours_0, theirs_0 = socket.socketpair()
    watch = leaving.watch(1, 2, {0: ours_0})
    watch.leave()  # this process finishes first: it says so, and whatever the peer does next is no death
    theirs_0.settimeout(5)
    assert theirs_0.recv(64) == b"bye\n"
    theirs_0.close()
    time.sleep(0.5)
    assert verdicts.lines == leaving.lines == [] and verdicts.codes == leaving.codes == []


def test_the_rendezvous_leaves_links_that_name_a_process_that_dies():
    layout = lambda i: ProcessLayout(f"127.0.0.1:{free_port}", 3, i, "flags")
    free_port = free_port_pair()
    links = {}
    threads = [threading.Thread(target=lambda i=i: links.__setitem__(i, rendezvous(layout(i), timeout=20)))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(links[0]) == [1, 2] and list(links[1]) == list(links[2]) == [0]
    verdicts = [Verdicts() for _ in range(3)]
    for i in (0, 2):
        verdicts[i].watch(i, 3, links[i])
    links[1][0].close()  # process 1 dies
    assert verdicts[0].wait() == ["jaxllm: process 1 of 3 stopped responding (link to process 0 closed); exiting "
                                  "so the job can be requeued"]
    links[0][2].close()  # process 0 exits after telling process 2
    assert verdicts[2].wait() == ["jaxllm: process 1 of 3 stopped responding (link to process 2 closed); exiting "
                                  "so the job can be requeued"]
