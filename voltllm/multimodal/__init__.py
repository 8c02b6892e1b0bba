"""Image input for the natively multimodal Qwen3.5 and Qwen3-VL models: the request-side types (inputs.py), M-RoPE
positions (mrope.py), media fetching and preprocessing (frontend), and the vision encoder (vision_tower.py)."""
