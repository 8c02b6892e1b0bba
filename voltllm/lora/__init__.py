"""LoRA adapters (vLLM's --enable-lora): PEFT adapters added to the llama family's attention, dense-MLP and MoE expert
projections, per request, with requests of different adapters (and none) in one batch.

  request.py   LoRARequest (vLLM's: name, id, path), what a request names its adapter with
  adapter.py   reading and checking a PEFT adapter (adapter_config.json + weights) against the model's projections
  layers.py    the stacked per-slot weights attached to a Linear, and the delta it adds after the base product
  experts.py   the slots of a sparse MoE layer's routed experts, and the experts' forward with their terms inside
  stages.py    an adapter's part on one pipeline stage (its layers, under local indices)
  manager.py   the engine side: known adapters (CPU, --max-cpu-loras), GPU slots (--max-loras), each step's mask
  modules.py   --lora-modules (the server's named adapters)
"""
