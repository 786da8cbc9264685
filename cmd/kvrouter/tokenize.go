package main

import (
	"encoding/json"
	"fmt"

	"github.com/kvrouter/kvrouter/adapters/hftokenizer"
	"github.com/spf13/cobra"
)

func newTokenizeCmd() *cobra.Command {
	var (
		path       string
		text       string
		addSpecial bool
	)
	cmd := &cobra.Command{
		Use:   "tokenize",
		Short: "Print the token ids of a text as a JSON array, tokenized in process",
		Long: `Encodes --text with a Hugging Face tokenizer.json the way kvrouter's
in-process tokenizer does, and prints the ids as a JSON array: a way to
compare with an engine's /tokenize. --tokenizer is a directory holding
tokenizer.json (and tokenizer_config.json) or the tokenizer.json file; .gz
copies are read too.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tok, err := hftokenizer.Load(path)
			if err != nil {
				return err
			}
			ids, err := tok.Encode(text, addSpecial)
			if err != nil {
				return err
			}
			out, err := json.Marshal(ids)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), string(out))
			return err
		},
	}
	cmd.Flags().StringVar(&path, "tokenizer", "", "tokenizer directory or tokenizer.json file")
	cmd.Flags().StringVar(&text, "text", "", "text to tokenize")
	cmd.Flags().BoolVar(&addSpecial, "add-special-tokens", true, "add the tokens the tokenizer puts around a prompt (BOS), as engines do for completions")
	_ = cmd.MarkFlagRequired("tokenizer")
	return cmd
}
