#!/usr/bin/env bash
# Main job: a producer and a consumer process move KV blocks over NIXL and verify every byte.
source "$(dirname "$0")/_venv.sh"
exec kvxfer demo "$@"
