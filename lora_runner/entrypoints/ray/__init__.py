"""``lora-runner serve --num-replicas N``: the OpenAI server's engine replicas on Ray Serve."""
