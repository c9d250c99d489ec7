"""python -m dpsync: what is installed. The summary of `dpsync-info` when that executable is on
PATH; otherwise the version, the library's path and the plan for 2 host replicas."""

import json
import shutil
import subprocess
import sys

import dpsync


def main() -> int:
    info = shutil.which("dpsync-info")
    if info is not None:
        done = subprocess.run([info], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
        if done.returncode == 0:
            sys.stdout.write(done.stdout)
            return 0
        print("%s failed (exit %d):\n%s" % (info, done.returncode, done.stdout.rstrip()))
    print("dpsync %s (Python package %s)" % (dpsync.version(), dpsync.__version__))
    print("library: %s" % dpsync.library_path())
    print("plan for 2 host replicas:")
    print(json.dumps(dpsync.plan_describe(host_replicas=2), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
