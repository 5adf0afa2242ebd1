#!/usr/bin/env bash
# Create (or refresh) .venv-tf: .venv with another transformers in front of it,
# so CI runs the fast suite under the newest transformers pyproject.toml's range
# admits as well as under the pinned one (constraints.txt).
#   scripts/side_transformers.sh            the newest version the range admits (and the index can install)
#   scripts/side_transformers.sh 5.24.0     that version (must be in the range)
# Prints the version it installed. Needs scripts/setup.sh first (.venv).
#
# .venv-tf is a venv whose site-packages holds only transformers and the
# dependencies of it that .venv does not satisfy (tokenizers, say), each
# installed with --no-deps --ignore-installed so pip never touches .venv; a
# .pth file then adds .venv's site-packages behind its own (site.addsitedir, so
# .venv's own .pth files, the editable m2nkit finder among them, run too).
# Everything else (torch, m2nkit, pytest, vLLM) is .venv's. A few seconds once
# the wheels are cached.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN=.venv/bin/python
SIDE=.venv-tf
[ -x "$MAIN" ] || { echo "side_transformers: run scripts/setup.sh first (no $MAIN)" >&2; exit 1; }
MAIN_SITE=$("$MAIN" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYBIN=$("$MAIN" -c 'import sys; print(sys._base_executable)')
[ -x "$SIDE/bin/python" ] || "$PYBIN" -m venv --without-pip "$SIDE"
SIDE_SITE=$("$SIDE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf 'import site; site.addsitedir(%s)\n' "'$(realpath "$MAIN_SITE")'" > "$SIDE_SITE/m2nkit-main-venv.pth"
# The range pyproject.toml declares, read by the same interpreter.
RANGE=$("$SIDE/bin/python" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if re.match(r"transformers\b", d)).replace(" ", ""))
EOF
)
# The versions to try, newest first: the one asked for, else every release in
# the range (pip's index listing), of which the first whose dependencies the
# index can satisfy wins. A release can need a package the index does not have
# yet (transformers 5.25.0 needs kernels>=0.19.1, not yet published): that
# release is skipped with a message instead of failing CI.
if [ -n "${1:-}" ]; then
    CANDIDATES=("$1")
else
    LISTED=$("$MAIN" -m pip index versions transformers 2>/dev/null |
             sed -n 's/^Available versions: //p')
    mapfile -t CANDIDATES < <("$SIDE/bin/python" - "$RANGE" "$LISTED" <<'EOF'
import sys
from packaging.requirements import Requirement
from packaging.version import Version
spec = Requirement(sys.argv[1]).specifier
found = sorted({Version(v.strip()) for v in sys.argv[2].split(",") if v.strip()}, reverse=True)
print("\n".join(str(v) for v in found if spec.contains(v)))
EOF
)
    # No listing (an index without the JSON API): the range alone, newest first.
    [ ${#CANDIDATES[@]} -gt 0 ] && [ -n "${CANDIDATES[0]}" ] || CANDIDATES=("")
fi
# pip from .venv, aimed at .venv-tf's site-packages; never at .venv.
PIP=("$MAIN" -m pip install -q --disable-pip-version-check --no-deps --ignore-installed
     --target "$SIDE_SITE" --upgrade --no-compile)
installed=""
for v in "${CANDIDATES[@]:0:5}"; do
    # A release tried before leaves its dist-info beside the next one's: clear it.
    rm -rf "$SIDE_SITE"/transformers "$SIDE_SITE"/transformers-*.dist-info
    "${PIP[@]}" "$RANGE" ${v:+"transformers==$v"}
    # Dependencies of that transformers which .venv + .venv-tf do not satisfy.
    MISSING=$("$SIDE/bin/python" - <<'EOF'
from importlib.metadata import PackageNotFoundError, distribution, version
from packaging.requirements import Requirement
out = []
for text in distribution("transformers").requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        out.append(str(req).split(";")[0])
print("\n".join(out))
EOF
)
    if [ -n "$MISSING" ]; then
        mapfile -t REQS <<<"$MISSING"
        if ! "${PIP[@]}" "${REQS[@]}"; then
            echo "side_transformers: transformers ${v:-(newest)} needs ${REQS[*]}, which the" \
                 "package index cannot provide; trying the next older release" >&2
            continue
        fi
    fi
    installed=yes
    break
done
[ -n "$installed" ] || { echo "side_transformers: no transformers release in $RANGE installs" \
                              "(tried: ${CANDIDATES[*]:0:5})" >&2; exit 1; }
"$SIDE/bin/python" - "$RANGE" <<'EOF'
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
import transformers, m2nkit  # noqa: F401 - both must import
v = transformers.__version__
assert Requirement(sys.argv[1]).specifier.contains(v), f"transformers {v} is not in {sys.argv[1]}"
print(f"side_transformers: .venv-tf has transformers {v} ({sys.argv[1]}; .venv has "
      f"{version('torch')} torch, m2nkit from {m2nkit.__file__.rsplit('/', 2)[0]})")
EOF
