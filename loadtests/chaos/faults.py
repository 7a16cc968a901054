"""The faults `strata chaos` injects, one class each (see `loadtests.chaos.phase.Fault`).

- `kill-9`: SIGKILL the daemon, restart it at once on the same port and data folder (SSD pages
  must survive or be missing, never wrong), twice in the fault window.
- `full-disk`: the SSD tier on a size-limited tmpfs (`mount -t tmpfs -o size=...`, needs root);
  the fault remounts it at the size already used, so every SSD write meets ENOSPC, then gives
  the room back.
- `flip-bytes`: XOR bytes at random offsets of the SSD segment files (`<ssd>/NNNNNNNN.seg`)
  while the daemon serves them.
- `stall-client`: SIGSTOP a client process that puts and gets big prompts (so it is often
  holding a reservation or a read lease), past the lease time, then SIGCONT it; counts the
  stalls that caught it holding a lease (the daemon's lease expiries rose).
- `slow-disk`: every SSD payload write takes 200 ms (`ssd.fault_write_delay_ms`, set when the
  daemon starts, so it is on for the whole phase), under a put load that forces demotion.
- `ssd-errors`: SSD payload reads fail with EIO at 20 % and writes at 5 %
  (`ssd.fault_read_error_rate`, `ssd.fault_write_error_rate`), whole phase.
- `etcd-stop`: three daemons registered in one etcd, clients through `ClusterClient`; etcd is
  SIGSTOPped for the fault window, then SIGCONTed.
- `net-loss`: the daemon in a network namespace this command creates, clients over TCP through
  a veth pair; `tc netem` adds delay and loss on both ends. Where netem is missing (no
  sch_netem in the kernel) an nftables rule inside the namespace drops 3 % of the packets each
  way instead (loss, no delay), and the output says so; with neither, the fault is skipped.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from loadtests.chaos.phase import LEASE_TTL_MS, Fault, PhaseEnv, wait_until
from loadtests.etcd import EtcdProcess


def _pause(seconds: float) -> None:
    threading.Event().wait(max(0.0, seconds))


class Kill9(Fault):
    name = "kill-9"

    def settings(self, env: PhaseEnv) -> list[str]:
        return ["--write-through"]  # most pages on SSD: what a crash must keep

    def inject(self, env: PhaseEnv, until: float) -> None:
        """Two crashes: at the start of the window and half way (or as soon as the first
        restart is done, on a slow machine)."""
        daemon = env.daemons[0]
        middle = (time.monotonic() + until) / 2
        for kill in (1, 2):
            daemon.kill()
            daemon.start()
            env.details["kills"] = kill
            if kill == 1:
                wait_until(middle)
        wait_until(until)


class FullDisk(Fault):
    name = "full-disk"
    tmpfs_bytes = 128 << 20

    def __init__(self) -> None:
        self.mount = Path()

    def skip_reason(self) -> str:
        return "" if os.geteuid() == 0 else "mounting a tmpfs needs root"

    def setup(self, env: PhaseEnv) -> str:
        self.mount = env.folder / "ssd-tmpfs"
        self.mount.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_bytes}", "strata-chaos",
             str(self.mount)], capture_output=True, text=True, timeout=30, check=False,
        )
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.strip()}"
        env.notes.append(f"SSD tier on a {self.tmpfs_bytes >> 20} MiB tmpfs")
        return ""

    def settings(self, env: PhaseEnv) -> list[str]:
        return ["--write-through", "--ssd-path", str(self.mount)]

    def _resize(self, size: int) -> bool:
        done = subprocess.run(["mount", "-o", f"remount,size={size}", str(self.mount)],
                              capture_output=True, text=True, timeout=30, check=False)
        return done.returncode == 0

    def inject(self, env: PhaseEnv, until: float) -> None:
        # shrink to what is used now (plus one 64 KiB step: writes go on meanwhile, and tmpfs
        # refuses a size below its use), so the next SSD writes meet ENOSPC
        for _ in range(50):
            st = os.statvfs(self.mount)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            if self._resize(used + (64 << 10)):
                env.details["disk_full_at_bytes"] = used
                break
        else:
            raise RuntimeError(f"could not shrink the tmpfs at {self.mount} to its use")
        wait_until(until)
        if not self._resize(self.tmpfs_bytes):
            raise RuntimeError(f"could not give the tmpfs at {self.mount} its room back")

    def teardown(self, env: PhaseEnv) -> None:
        if self.mount != Path():
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True, timeout=30,
                           check=False)


class FlipBytes(Fault):
    name = "flip-bytes"

    def settings(self, env: PhaseEnv) -> list[str]:
        return ["--write-through"]

    def inject(self, env: PhaseEnv, until: float) -> None:
        rng = random.Random(11)
        folder = env.daemons[0].data_dir / "ssd"
        flips = 0
        while time.monotonic() < until:
            segs = [p for p in folder.rglob("*.seg") if p.stat().st_size > 0]
            if segs:
                path = rng.choice(segs)
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:  # compacted away meanwhile
                    continue
                try:
                    size = os.fstat(fd).st_size
                    for _ in range(8):
                        off = rng.randrange(size)
                        old = os.pread(fd, 1, off)
                        if old:
                            os.pwrite(fd, bytes([old[0] ^ 0xFF]), off)
                            flips += 1
                finally:
                    os.close(fd)
            _pause(0.1)
        env.details["bytes_flipped"] = flips
        with env.stats_client(env.daemons[0]) as c:
            env.details["corrupt_dropped"] = c.stats().corrupt_dropped


class StallClient(Fault):
    name = "stall-client"
    dram = "96MiB"  # room for the victim's 16 MiB prompts beside everyone's pages

    def worker_args(self, env: PhaseEnv, index: int) -> list[str]:
        if index == 0:  # the victim: 16 x 1 MiB prompts, so a copy is often in flight
            env.victims.add(0)
            return ["--pages", "16", "--page-kib", "1024", "--put-share", "0.5"]
        return []

    def inject(self, env: PhaseEnv, until: float) -> None:
        victim = env.workers[0]
        stall_s = LEASE_TTL_MS / 1000 + 1.0
        stalls = caught = 0
        with env.stats_client(env.daemons[0]) as c:
            # at least two stalls, even past `until` (a short run still stalls the client)
            while stalls < 2 or (stalls < 20 and time.monotonic() + stall_s < until):
                _pause(random.Random(stalls).uniform(0.05, 0.3))
                os.kill(victim.pid, signal.SIGSTOP)
                before = c.stats().lease_expiries
                _pause(stall_s)
                after = c.stats().lease_expiries
                os.kill(victim.pid, signal.SIGCONT)
                stalls += 1
                caught += after > before
        env.details["stalls"] = stalls
        env.details["stalls_holding_a_lease"] = caught
        env.notes.append(f"{caught}/{stalls} stalls caught the client holding a lease")
        wait_until(until)


class SlowDisk(Fault):
    name = "slow-disk"
    delay_ms = 200
    dram = "8MiB"  # the load passes DRAM's high watermark: demotions go through the slow disk

    def worker_args(self, env: PhaseEnv, index: int) -> list[str]:
        return ["--pages", "4"]  # each demotion write takes delay_ms: keep the volume small

    def settings(self, env: PhaseEnv) -> list[str]:
        env.notes.append(f"every SSD write {self.delay_ms} ms, whole phase")
        return ["--set", f"ssd.fault_write_delay_ms={self.delay_ms}"]


class SsdErrors(Fault):
    name = "ssd-errors"

    def settings(self, env: PhaseEnv) -> list[str]:
        env.notes.append("SSD reads fail 20 %, writes 5 %, whole phase")
        return ["--set", "ssd.fault_read_error_rate=0.2",
                "--set", "ssd.fault_write_error_rate=0.05"]


class EtcdStop(Fault):
    name = "etcd-stop"
    nodes = 3

    def __init__(self) -> None:
        self.etcd: EtcdProcess | None = None

    def setup(self, env: PhaseEnv) -> str:
        try:
            self.etcd = EtcdProcess(env.folder / "etcd").start()
        except FileNotFoundError as exc:
            return str(exc)
        env.etcd_url = self.etcd.url
        return ""

    def settings(self, env: PhaseEnv) -> list[str]:
        return ["--set", f"cluster.etcd_endpoints={env.etcd_url}", "--set", "cluster.name=chaos",
                "--set", "cluster.lease_ttl_s=5"]

    def inject(self, env: PhaseEnv, until: float) -> None:
        assert self.etcd is not None
        os.kill(self.etcd.pid, signal.SIGSTOP)
        try:
            wait_until(until)
        finally:
            os.kill(self.etcd.pid, signal.SIGCONT)

    def teardown(self, env: PhaseEnv) -> None:
        if self.etcd is not None:
            self.etcd.kill()  # SIGKILL ends a stopped process too


class NetLoss(Fault):
    """Delay and loss between clients and a daemon in a network namespace made here."""

    name = "net-loss"

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}"
        self.ns = f"strata-chaos-{tag}"
        self.host_if, self.ns_if = f"sch{tag}", f"scn{tag}"
        k = os.getpid() % 250
        self.host_ip, self.ns_ip = f"10.213.{k}.1", f"10.213.{k}.2"
        self.made = False
        self.mode = ""  # "netem" (delay and loss) or "nft" (loss only)

    def skip_reason(self) -> str:
        return "" if os.geteuid() == 0 else "network namespaces need root"

    def _ip(self, *args: str, ns: bool = False) -> subprocess.CompletedProcess[str]:
        cmd = ["ip", "netns", "exec", self.ns, *args] if ns else list(args)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)

    def setup(self, env: PhaseEnv) -> str:
        steps = [
            (["ip", "netns", "add", self.ns], False),
            (["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
             False),
            (["ip", "link", "set", self.ns_if, "netns", self.ns], False),
            (["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if], False),
            (["ip", "link", "set", self.host_if, "up"], False),
            (["ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if], True),
            (["ip", "link", "set", self.ns_if, "up"], True),
            (["ip", "link", "set", "lo", "up"], True),
        ]
        for cmd, in_ns in steps:
            done = self._ip(*cmd, ns=in_ns)
            self.made = True
            if done.returncode != 0:
                return f"cannot build the namespace ({' '.join(cmd)}: {done.stderr.strip()})"
        probe = self._ip("tc", "qdisc", "add", "dev", self.host_if, "root", "netem", "delay", "1ms")
        if probe.returncode == 0:
            self._ip("tc", "qdisc", "del", "dev", self.host_if, "root")
            self.mode = "netem"
        else:
            why = probe.stderr.strip()
            nft = self._ip("nft", "add", "table", "inet", "strata_chaos", ns=True)
            if nft.returncode != 0:
                return f"tc netem unavailable here ({why}), and nftables too ({nft.stderr.strip()})"
            self._ip("nft", "delete", "table", "inet", "strata_chaos", ns=True)
            self.mode = "nft"
            env.notes.append(f"tc netem unavailable ({why}): 3 % loss each way by an nftables "
                             "random-drop rule inside the namespace, no added delay")
        env.daemon_prefix = ["ip", "netns", "exec", self.ns]
        env.daemon_host = self.ns_ip
        env.notes.append(f"daemon in netns {self.ns} at {self.ns_ip}, clients over TCP")
        return ""

    def worker_args(self, env: PhaseEnv, index: int) -> list[str]:
        return ["--transport", "tcp"]

    def inject(self, env: PhaseEnv, until: float) -> None:
        if self.mode == "nft":
            self._drop_rules()
            try:
                wait_until(until)
            finally:
                listed = self._ip("nft", "list", "table", "inet", "strata_chaos", ns=True).stdout
                env.details["packets_dropped"] = sum(
                    int(n) for n in re.findall(r"counter packets (\d+)", listed))
                self._ip("nft", "delete", "table", "inet", "strata_chaos", ns=True)
            return
        netem = ["root", "netem", "delay", "20ms", "10ms", "loss", "3%"]
        self._ip("tc", "qdisc", "add", "dev", self.host_if, *netem)
        self._ip("tc", "qdisc", "add", "dev", self.ns_if, *netem, ns=True)
        try:
            wait_until(until)
        finally:
            self._ip("tc", "qdisc", "del", "dev", self.host_if, "root")
            self._ip("tc", "qdisc", "del", "dev", self.ns_if, "root", ns=True)

    def _drop_rules(self) -> None:
        """3 % of the TCP packets into and out of the daemon's namespace dropped (its veth)."""
        self._ip("nft", "add", "table", "inet", "strata_chaos", ns=True)
        for chain, hook, where in (("in", "input", "iifname"), ("out", "output", "oifname")):
            self._ip("nft", "add", "chain", "inet", "strata_chaos", chain,
                     f"{{ type filter hook {hook} priority 0; policy accept; }}", ns=True)
            done = self._ip("nft", "add", "rule", "inet", "strata_chaos", chain, where, self.ns_if,
                            "meta", "l4proto", "tcp", "numgen", "random", "mod", "100", "<", "3",
                            "counter", "drop", ns=True)
            if done.returncode != 0:
                raise RuntimeError(f"nft rule refused: {done.stderr.strip()}")

    def teardown(self, env: PhaseEnv) -> None:
        if self.made:
            self._ip("ip", "link", "del", self.host_if)
            self._ip("ip", "netns", "del", self.ns)


FAULTS: dict[str, type[Fault]] = {
    f.name: f
    for f in (Kill9, FullDisk, FlipBytes, StallClient, SlowDisk, SsdErrors, EtcdStop, NetLoss)
}
CI_FAULTS = ("kill-9", "flip-bytes", "stall-client", "slow-disk")
