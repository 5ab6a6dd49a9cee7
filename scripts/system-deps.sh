#!/usr/bin/env bash
# System services the tests start: a real redis-server (the Redis storage channel's tests).
set -euo pipefail
if ! command -v redis-server >/dev/null; then
  sudo=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
fi
