"""Data: preparing a token store from raw text in stages (`prepare`, `clean`, `dedup`, `stages`, `prep_config`,
`corpus`), tokenizers (`tokenizer`, `hf_tokenizer`), the token store and the packed-row loader (`token_store`,
`pipeline`, `synthetic`), and the prepared rows of SFT, preference pairs and RL prompts (`sft`, `sft_template`,
`preference`, `prompts`, `row_prep`)."""
