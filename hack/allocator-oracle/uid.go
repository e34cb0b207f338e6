package main

import "k8s.io/apimachinery/pkg/types"

// typesUID gives share IDs a fixed value, so answers compare across runs.
type typesUID string

func (u *typesUID) uid() *types.UID {
	id := types.UID(*u)
	return &id
}
