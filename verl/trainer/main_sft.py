"""`python -m verl.trainer.main_sft` (or under torchrun): the FSDP2 SFT trainer's entry point, an alias
of `verl.trainer.fsdp_sft_trainer` kept for upstream's command lines."""

from verl.trainer.fsdp_sft_trainer import main

if __name__ == "__main__":
    main()
