# Sourced by setup.sh and lock.sh: uv at a pinned version in its own virtual environment (installed
# with pip the first time), and this host's pip settings (find-links, index URLs, certificate) as
# uv arguments, so that uv sees what pip sees: PyPI, the local index folders, the local CPU build
# of torch. Needs ROOT and PYTHON; sets UV and UV_SOURCES.
UV_VERSION="0.13.9"
UV_TOOLS="${BIONEMO_EXPORT_LOCK_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/bionemo-export/uv-$UV_VERSION}"

if [ "$("$UV_TOOLS/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  printf '[uv] installing uv %s into %s\n' "$UV_VERSION" "$UV_TOOLS"
  "$PYTHON" -m venv --clear "$UV_TOOLS"
  "$UV_TOOLS/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
UV="$UV_TOOLS/bin/uv"

# One of pip's settings as pip reads it (pip.conf files, PIP_* variables); several values are
# separated by whitespace.
pip_setting() {
  "$UV_TOOLS/bin/python" -m pip config list 2>/dev/null |
    sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | tr -s ' \t' '\n' | awk 'NF && !seen[$0]++'
}
UV_SOURCES=(--index-strategy unsafe-best-match)  # like pip: the best version across all indexes
while read -r url; do UV_SOURCES+=(--index-url "$url"); done < <(pip_setting index-url | head -n1)
while read -r url; do UV_SOURCES+=(--extra-index-url "$url"); done < <(pip_setting extra-index-url)
while read -r dir; do UV_SOURCES+=(--find-links "$dir"); done < <(pip_setting find-links)
uv_cert="$(pip_setting cert | head -n1)"
if [ -n "$uv_cert" ] && [ -z "${SSL_CERT_FILE:-}" ]; then export SSL_CERT_FILE="$uv_cert"; fi
