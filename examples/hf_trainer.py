"""Train a causal LM with transformers' Trainer, pipelined by pp_tp (pp2 x tp2 on 4 ranks):

    torchrun --nproc-per-node 4 examples/hf_trainer.py [--model DIR] [--out DIR]

A plain Trainer script; the only pp_tp lines are the import and `parallel=`. The default model is the small Llama
of toml_configs/hf_tiny (random init, its tokenizer), trained on the shipped text pp_tp/data/patterns.txt.
"""

import argparse

from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TrainingArguments,
)

from pp_tp import ParallelConfig
from pp_tp.integrations.hf_trainer import PipelineTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="toml_configs/hf_tiny", help="an HF model directory (weights optional)")
parser.add_argument("--out", default="runs/hf_trainer")
cli = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(cli.model)
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
try:
    model = AutoModelForCausalLM.from_pretrained(cli.model)
except OSError:  # a directory with a config only: random weights
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cli.model))

with open("pp_tp/data/patterns.txt") as f:
    text = Dataset.from_dict({"text": [line.strip() for line in f if line.strip()]})
train = text.map(lambda b: tokenizer(b["text"], truncation=True, max_length=64), batched=True, remove_columns=["text"])

args = TrainingArguments(
    output_dir=cli.out,
    max_steps=30,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=4,
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=3,
    logging_steps=5,
    max_grad_norm=1.0,
    save_steps=15,
    report_to=[],
    use_cpu=True,  # drop on GPUs (torchrun gives each rank its GPU)
)
trainer = PipelineTrainer(
    model,
    args,
    train_dataset=train,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    processing_class=tokenizer,
    parallel=ParallelConfig(pp=2, tp=2),  # microbatches: gradient_accumulation_steps
)
trainer.train()
trainer.save_model(f"{cli.out}/final")  # HF safetensors: AutoModelForCausalLM.from_pretrained loads it
