"""SGLang's theory: its memory budget, pools, schedule policy and scheduler, per release."""
