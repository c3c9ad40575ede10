# The hook every sandboxed Python process loads as sitecustomize; rlstream prepends `_CONFIG = {...}` per run
# (rlstream/sandbox/process.py). Audit hooks are not a security boundary (PEP 578): the namespaces and limits are.
def _install(cfg):
    import os, shutil, sys
    work, hookdir, exe, programs = cfg["work"], cfg["hookdir"], cfg["exe"], frozenset(cfg["programs"])
    readable, exact = tuple(cfg["read"]), frozenset(cfg["exact"])
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked_modules = ("ctypes", "_ctypes", "cffi", "_cffi_backend")  # raw syscalls would bypass every check

    def inside(p, roots):
        return any(p == r or p.startswith(r + sep) for r in roots)

    def deny(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def check_path(path, writing):
        if path is None or isinstance(path, int):
            return
        p = realpath(fsdecode(path))  # resolves symlinks planted in the work dir
        if inside(p, (work,)) or p in exact or (not writing and inside(p, readable)):
            return
        deny(("writing " if writing else "reading ") + p)

    def check_address(addr):
        if isinstance(addr, (str, bytes)):
            a = fsdecode(addr)
            if a and not a.startswith("\0") and inside(realpath(a), (work,)):
                return  # a unix socket of the snippet's own
        deny(f"network access to {addr!r}")

    def check_exec(path, args, env):
        args = [fsdecode(a) for a in (args or ())]
        prog = fsdecode(path if path is not None else (args[0] if args else ""))
        if sep not in prog:
            prog = shutil.which(prog) or prog
        if realpath(prog) in programs:
            return  # a program the caller allowed (the shell tool's /bin/sh); it runs without these hooks
        if realpath(prog) != exe:
            deny(f"running {prog}")
        pp = next((fsdecode(v) for k, v in (os.environ if env is None else env).items()
                   if fsdecode(k) == "PYTHONPATH"), "")
        if pp.split(os.pathsep)[0] != hookdir:
            deny("starting Python without the sandbox hooks")
        for a in args[1:]:
            if not a.startswith("-") or a.startswith(("--", "-W", "-X")):
                continue  # option values, long options and -W/-X settings hold no mode letters
            if set(a[1:]) & set("IES"):
                deny(f"python flag {a}")
            if set(a[1:]) & set("cm"):
                break

    def hook(event, args):
        if event == "open":
            flags = args[2] if isinstance(args[2], int) else 0
            mode = args[1] if isinstance(args[1], str) else ""
            check_path(args[0], bool(flags & writes) or any(c in mode for c in "wax+"))
        elif event in ("os.listdir", "os.scandir"):
            check_path(args[0], False)
        elif event == "socket.__new__":
            if args[1] != 1:  # only AF_UNIX: asyncio's self-pipe needs socketpair()
                deny("opening a network socket")
        elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            check_address(args[1])
        elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                       "socket.getnameinfo"):
            deny("name resolution")
        elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn"):
            check_exec(args[0], args[1], args[2] if len(args) > 2 else None)
        elif event in ("os.system", "gc.get_objects", "gc.get_referrers", "gc.get_referents"):
            deny(event)
        elif event == "import" and str(args[0]).rpartition(".")[2] in blocked_modules:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")

    previous = sys.excepthook

    def excepthook(kind, value, tb):
        previous(kind, value, tb)
        if issubclass(kind, MemoryError):
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(cfg["memory_exit"])

    sys.excepthook = excepthook
    sys.addaudithook(hook)


_install(_CONFIG)
del _install, _CONFIG
