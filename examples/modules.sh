#!/usr/bin/env bash
# Named modules with curl: upload a module file, steer a completion with a part of it, delete it.
#   examples/modules.sh BASE_URL MODEL FILE.safetensors|FILE.gguf [STEER_API_KEY]
set -euo pipefail
base="$1" model="$2" file="$3" key="${4:-}"
auth=(); [ -n "$key" ] && auth=(-H "authorization: Bearer $key")
curl -sf "${auth[@]}" "$base/v1/steering/modules" -F name=demo -F replace=true -F "file=@$file"; echo
curl -sf "$base/v1/steering/modules/demo"; echo
# the module at half strength, on a layer range only (as llama.cpp's --control-vector-layer-range)
curl -sf "$base/v1/completions" -H 'content-type: application/json' -d "{\"model\": \"$model\",
  \"prompt\": \"Today the weather is bad and I feel\", \"max_tokens\": 12, \"temperature\": 0,
  \"steering_module\": {\"name\": \"demo\", \"scale\": 0.5, \"layers\": \"6-10\"}}"; echo
curl -sf "${auth[@]}" -X DELETE "$base/v1/steering/modules/demo"; echo
