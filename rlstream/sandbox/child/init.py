# The trusted first process inside the sandbox: hides folders, applies the limits to the snippet's process in
# preexec_fn (single-threaded here, so that is safe), waits, reports its pid, exit and CPU time as JSON lines on
# the status fd. Run as `python -I -c <this text> CONFIG_JSON STATUS_FD` (rlstream/sandbox/process.py).
import json, os, resource, subprocess, sys
cfg, status = json.loads(sys.argv[1]), int(sys.argv[2])
def report(**kw):
    os.write(status, (json.dumps(kw) + "\n").encode())
report(pid=int(os.readlink("/proc/self")))  # the host pid: /proc is still the host's
def mount(src, dst, fs, flags, data):
    if libc.mount(src.encode(), dst.encode(), fs and fs.encode(), flags, data and data.encode()):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {dst}: {os.strerror(err)}")
def limits():
    for name, soft, hard in cfg["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
try:
    if cfg["hide"]:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for i, (path, keeps) in enumerate(cfg["hide"]):
            staged = []
            for j, keep in enumerate(keeps):  # park the Python install, cover its parent, put it back
                park = os.path.join(cfg["park"], f"{i}-{j}")
                os.mkdir(park)
                mount(keep, park, None, 4096 | 16384, None)  # MS_BIND | MS_REC
                staged.append((park, keep))
            mount("tmpfs", path, "tmpfs", 2 | 4, "size=64k,mode=755")  # MS_NOSUID | MS_NODEV
            for park, keep in staged:
                os.makedirs(keep, exist_ok=True)
                mount(park, keep, None, 4096 | 16384, None)
                libc.umount2(park.encode(), 2)  # MNT_DETACH
    child = subprocess.Popen(cfg["argv"], cwd=cfg["cwd"], env=cfg["env"], stdin=subprocess.DEVNULL,
                             preexec_fn=limits)
except Exception as exc:
    report(error=f"{type(exc).__name__}: {exc}")
    sys.exit(1)
_, st, ru = os.wait4(child.pid, 0)
child.returncode = code = os.waitstatus_to_exitcode(st)
report(exit=code, cpu_s=ru.ru_utime + ru.ru_stime)
