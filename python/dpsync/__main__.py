"""python -m dpsync: what is installed. The version and the path of the library this package
loads, then the summary of `dpsync-info` when that executable is on PATH, otherwise the plan for
2 host replicas."""

import json
import shutil
import subprocess
import sys

import dpsync


def main() -> int:
    # dpsync-info reports the library it was linked with, which need not be the one this
    # package loads: say which one that is first.
    print("dpsync %s (Python package %s)" % (dpsync.version(), dpsync.__version__))
    print("library: %s" % dpsync.library_path())
    info = shutil.which("dpsync-info")
    if info is not None:
        done = subprocess.run([info], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
        if done.returncode == 0:
            sys.stdout.write(done.stdout)
            return 0
        print("%s failed (exit %d):\n%s" % (info, done.returncode, done.stdout.rstrip()))
    print("plan for 2 host replicas:")
    print(json.dumps(dpsync.plan_describe(host_replicas=2), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
